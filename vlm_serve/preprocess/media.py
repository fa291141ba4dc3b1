"""Load request images from `data:` URLs, http(s) URLs and allowed local files.

Runs on the CPU pool (see DESIGN.md): synchronous and blocking, never touches MLX.
Every failure a client can cause is a MediaError with a user-facing message, so the
API layer answers 400 instead of 500.

Error codes: "invalid_image_url" (malformed or unsupported URL), "image_url_forbidden"
(private address or local path refused by policy), "image_fetch_failed" (network,
timeout, HTTP status, redirects), "image_too_large" (bytes or pixels over the limit),
"invalid_image" (bytes that do not decode as a supported image).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import math
import os
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from vlm_serve.preprocess import url_safety
from vlm_serve.preprocess.image_cache import ImageCache, image_bytes, key_of, source_key, tag

# Register every Pillow plugin now, at import, not lazily inside a worker thread;
# Image.open(formats=...) also raises KeyError for a format not yet registered.
Image.init()
# Formats we decode. Pillow can open many more, but each decoder is attack surface
# (EPS even shells out to Ghostscript); these cover what clients actually send.
# MPO is how Pillow opens many phone-camera JPEGs.
_FORMATS = tuple(
    f for f in ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF") if f in Image.OPEN
)
_REDIRECTS = (301, 302, 303, 307, 308)
_URLSAFE_B64 = str.maketrans("-_", "+/")
_USER_AGENT = "vlm-serve"
# Building an SSL context (loading the CA bundle) costs ~20 ms; share one, it is thread-safe.
_SSL_CONTEXT = httpx.create_ssl_context()


@dataclass(frozen=True)
class MediaPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # decompression-bomb guard (width * height)
    fetch_timeout_s: float = 10.0  # total for one image, all redirect hops included
    max_redirects: int = 3
    allow_private_urls: bool = False  # --allow-private-media-urls
    allowed_local_path: str | None = None  # --allowed-local-media-path; None: refuse files
    min_image_pixels: int = 0  # --min-image-pixels: smaller images are upscaled to this area


class MediaError(ValueError):
    """A client-caused media failure; `message` is safe to return to the caller."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_image"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class PixelBudget:
    """Decoded pixels one request may still spend on its images, shared by the threads
    that decode them (checked from each image's header, before its pixels are decoded)."""

    def __init__(self, pixels: int):
        self.left = pixels
        self._lock = threading.Lock()

    def spend(self, width: int, height: int) -> None:
        with self._lock:
            if width * height > self.left:
                raise MediaError(
                    "the request's images have too many pixels in total", code="image_too_large"
                )
            self.left -= width * height


def load_image(
    url: str, policy: MediaPolicy, param: str | None = None, budget: PixelBudget | None = None,
    detail: str | None = None, cache: ImageCache | None = None,
) -> Image.Image:
    """Fetch and decode one image into a loaded RGB PIL image (first frame, EXIF-upright),
    within the resolution bounds of `fit_resolution`, tagged with its source key (see
    image_cache). With a cache, an image sent before is not decoded again: a data URL
    is looked up by its text before any base64 decoding, other URLs by their bytes.

    `param` names the request field (e.g. "messages[1].content[2].image_url") and is
    attached to any MediaError raised.
    """
    try:
        key = _data_url_key(url, policy, detail)
        if key is not None and (hit := _cached(cache, key, budget)) is not None:
            return hit
        data = read_image_bytes(url, policy)
        if key is None:
            key = source_key("bytes", data, fit_settings(policy, detail))
            if (hit := _cached(cache, key, budget)) is not None:
                return hit
        decoded = decode_image(data, policy, budget)
        image = tag(fit_resolution(decoded, policy, detail), key)
        if cache is not None:
            cache.put(key, (image, decoded.size), image_bytes(image))
        return image
    except MediaError as exc:
        exc.param = exc.param or param
        raise


def _data_url_key(url: str, policy: MediaPolicy, detail: str | None) -> str | None:
    """A data URL's source key, from its text as sent (hashing it costs a fraction of
    decoding its base64); None for other URLs, whose bytes are the key."""
    if not isinstance(url, str) or not url[:16].lstrip().lower().startswith("data:"):
        return None
    return source_key("data-url", url.encode("utf-8", "surrogatepass"), fit_settings(policy, detail))


def _cached(cache: ImageCache | None, key: str, budget: PixelBudget | None) -> Image.Image | None:
    """A loaded image from the cache; it still spends the request's pixel budget (the
    other limits it passed when it was first loaded, under the same policy)."""
    entry = cache.get(key) if cache is not None else None
    if entry is None:
        return None
    image, decoded_size = entry
    if budget is not None:
        budget.spend(*decoded_size)
    return image


# image_url.detail "low": the image is shrunk to fit this square (OpenAI's low detail is
# one 512x512 view); "high" and "auto" leave it to the model's processor.
LOW_DETAIL_SIZE = 512


def fit_resolution(image: Image.Image, policy: MediaPolicy, detail: str | None = None) -> Image.Image:
    """The image the processor sees: shrunk for detail "low", then grown to at least
    ``policy.min_image_pixels`` (aspect ratio kept both ways). Models whose image token
    count follows the image size get fewer (or more) tokens accordingly."""
    if detail == "low" and max(image.size) > LOW_DETAIL_SIZE:
        image = ImageOps.contain(image, (LOW_DETAIL_SIZE, LOW_DETAIL_SIZE), Image.Resampling.BICUBIC)
    width, height = image.size
    if width * height < policy.min_image_pixels:
        scale = math.sqrt(policy.min_image_pixels / (width * height))
        size = (math.ceil(width * scale), math.ceil(height * scale))
        image = image.resize(size, Image.Resampling.BICUBIC)
    return image


def fit_settings(policy: MediaPolicy, detail: str | None) -> str:
    """What decides the output of `fit_resolution` besides the image (for cache keys)."""
    low = f"low{LOW_DETAIL_SIZE}" if detail == "low" else "as-sent"
    return f"detail={low}:min_pixels={policy.min_image_pixels}"


def read_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The raw bytes behind an image URL, within the policy's limits."""
    if not isinstance(url, str) or not url.strip():
        raise MediaError("image URL is empty", code="invalid_image_url")
    url = url.strip()
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return _decode_data_url(url, policy)
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    if scheme == "file":
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("file URLs must name a local path", code="invalid_image_url")
        return _read_local(urllib.parse.unquote(parts.path), policy)
    if url.startswith("/"):
        return _read_local(url, policy)
    raise MediaError(
        "unsupported image URL: expected http(s)://, data:image/...;base64, or a local path",
        code="invalid_image_url",
    )


def decode_image(data: bytes, policy: MediaPolicy, budget: PixelBudget | None = None) -> Image.Image:
    """Decode bytes into a loaded RGB image, checking the pixel count before decoding."""
    if len(data) > policy.max_image_bytes:
        raise _too_large(policy)
    try:
        # Image.open parses only the header, so the size check below runs before any
        # pixel data is decoded.
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            width, height = image.size
            if width * height > policy.max_image_pixels:
                raise _too_many_pixels(width, height, policy)
            if budget is not None:
                budget.spend(width, height)
            # The whole upload to the decoder at once: Pillow gives up the interpreter lock
            # for each block it decodes (64 KB by default) and waits to get it back while
            # the MLX worker runs Python (a 0.5 MB JPEG beside a busy thread: 61 -> 23 ms;
            # bench/image_decode.py). A PNG is fed by its own chunks either way.
            image.decodermaxblock = max(image.decodermaxblock, len(data))
            image.load()  # first frame only; surface truncation and corruption here
            return _to_rgb(_exif_transpose(image))
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own guard (global MAX_IMAGE_PIXELS, which we leave alone) fired in
        # Image.open, before our check; the warning arrives as an exception only when
        # warnings are configured as errors.
        raise MediaError("image has too many pixels", code="image_too_large") from None
    except UnidentifiedImageError:
        raise MediaError(
            "image data is not a supported image format (PNG, JPEG, WebP, GIF, BMP, TIFF)"
        ) from None
    except Exception:
        # Pillow's decoders raise a zoo of types (OSError, SyntaxError, ValueError,
        # struct.error, ...) on bad input; all of them mean the client sent bad bytes.
        raise MediaError("could not decode image: the data is corrupt or truncated") from None


def cache_digest(image: Image.Image) -> str:
    """An image's digest for the prefix and vision caches: its source key when it was
    loaded from a request (see image_cache; no pass over its pixels), else a hash of
    its pixels. Equal digests mean equal pixels either way."""
    return key_of(image) or image_digest(image)


def image_digest(image: Image.Image) -> str:
    """A stable content hash of decoded pixels."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


# --- data: URLs ---------------------------------------------------------------------


def _decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaError("malformed data URL: missing ','", code="invalid_image_url")
    # The media type is ignored on purpose: clients often send a wrong or missing one,
    # and Pillow sniffs the real format from the bytes.
    if "base64" not in (token.strip().lower() for token in header.split(";")):
        raise MediaError(
            "data URLs must be base64-encoded (data:image/png;base64,...)",
            code="invalid_image_url",
        )
    if len(payload) * 3 // 4 <= policy.max_image_bytes:
        # Canonical base64, as clients send it, decodes without the clean-up passes
        # below (they cost as much as the decoding itself on a large image).
        with contextlib.suppress(binascii.Error, ValueError):
            return binascii.a2b_base64(payload, strict_mode=True)
    if "%" in payload:  # never in base64: the client percent-encoded the URL
        payload = urllib.parse.unquote(payload)
    # Tolerate line breaks, missing padding and the URL-safe alphabet.
    payload = "".join(payload.split()).rstrip("=").translate(_URLSAFE_B64)
    if len(payload) * 3 // 4 > policy.max_image_bytes:
        raise _too_large(policy)  # before decoding, so a huge payload costs no more memory
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL is not valid base64", code="invalid_image_url") from None


# --- http(s) URLs ---------------------------------------------------------------------


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise MediaError("malformed image URL", code="invalid_image_url") from None
    # trust_env=False: an environment proxy would connect on our behalf and bypass the
    # address checks. Redirects are followed by hand so every hop is checked.
    with httpx.Client(trust_env=False, follow_redirects=False, verify=_SSL_CONTEXT) as client:
        try:
            for _ in range(policy.max_redirects + 1):
                with _get(client, target, policy, deadline) as response:
                    location = response.headers.get("location")
                    if response.status_code in _REDIRECTS and location:
                        target = target.join(location)
                        continue
                    if not response.is_success:
                        raise MediaError(
                            f"could not fetch image from {target.host}: "
                            f"HTTP {response.status_code}",
                            code="image_fetch_failed",
                        )
                    return _read_capped(response, policy, deadline)
        except httpx.TimeoutException:
            raise MediaError(
                f"timed out fetching image from {target.host}", code="image_fetch_failed"
            ) from None
        except httpx.InvalidURL:  # a malformed Location header
            raise MediaError(
                "could not fetch image: bad redirect", code="image_fetch_failed"
            ) from None
        except (httpx.HTTPError, OSError) as exc:
            raise MediaError(
                f"could not fetch image from {target.host}: {str(exc) or type(exc).__name__}",
                code="image_fetch_failed",
            ) from None
    raise MediaError(
        f"could not fetch image: more than {policy.max_redirects} redirects",
        code="image_fetch_failed",
    )


@contextlib.contextmanager
def _get(
    client: httpx.Client, url: httpx.URL, policy: MediaPolicy, deadline: float
) -> Iterator[httpx.Response]:
    """Send one GET (no redirects) and yield the streaming response."""
    if url.scheme not in ("http", "https") or not url.host:
        raise MediaError("image URLs must be http(s) URLs with a host", code="invalid_image_url")
    headers = {"User-Agent": _USER_AGENT, "Accept": "image/*"}
    if policy.allow_private_urls:
        response = client.send(_request(client, url, headers, {}, deadline), stream=True)
    else:
        response = _send_pinned(client, url, headers, deadline)
    try:
        yield response
    finally:
        response.close()


def _send_pinned(
    client: httpx.Client, url: httpx.URL, headers: dict[str, str], deadline: float
) -> httpx.Response:
    """Connect to an address we checked, not to whatever the name resolves to next.

    Checking the resolved addresses and then letting httpx resolve again leaves a
    window for DNS rebinding (public address for the check, 127.0.0.1 for the
    connection). So the request goes to the checked IP itself, with the original Host
    header and TLS server name, so virtual hosts and certificate checks still work.
    """
    host = url.raw_host.decode("ascii")
    try:
        addresses = url_safety.resolve(host, url.port or (443 if url.scheme == "https" else 80))
    except OSError:
        raise MediaError(
            f"could not resolve image host {url.host}", code="image_fetch_failed"
        ) from None
    if not addresses or not all(url_safety.is_public_ip(a) for a in addresses):
        raise MediaError(
            f"image URL host {url.host} resolves to a private or reserved address",
            code="image_url_forbidden",
        )
    headers = {**headers, "Host": url.netloc.decode("ascii")}
    error = None
    for address in addresses:
        pinned = url.copy_with(host=address)
        request = _request(client, pinned, headers, {"sni_hostname": host}, deadline)
        try:
            return client.send(request, stream=True)
        except httpx.ConnectError as exc:
            error = exc  # try the next address, as connecting by name would
    raise error


def _request(
    client: httpx.Client, url: httpx.URL, headers: dict[str, str], extensions: dict, deadline: float
) -> httpx.Request:
    timeout = _remaining(deadline)
    return client.build_request("GET", url, headers=headers, extensions=extensions, timeout=timeout)


def _remaining(deadline: float) -> float:
    """Seconds left of the whole fetch; _fetch reports the timeout with the URL's host."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise httpx.TimeoutException("image fetch deadline exceeded")
    return remaining


def _read_capped(response: httpx.Response, policy: MediaPolicy, deadline: float) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_image_bytes:
        raise _too_large(policy)
    body = bytearray()
    # iter_bytes yields decompressed data, so the cap also bounds gzip bombs; the
    # deadline bounds a server that trickles bytes just inside the read timeout.
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > policy.max_image_bytes:
            raise _too_large(policy)
        _remaining(deadline)
    return bytes(body)


# --- local files ----------------------------------------------------------------------


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    if not policy.allowed_local_path:
        raise MediaError("local media paths are not allowed", code="image_url_forbidden")
    try:
        # realpath resolves symlinks and "..", so a link inside the root that points
        # outside it is judged by where it lands.
        root = os.path.realpath(policy.allowed_local_path)
        real = os.path.realpath(path)
    except (ValueError, OSError):  # e.g. an embedded NUL byte
        raise MediaError("invalid local image path", code="invalid_image_url") from None
    if not os.path.isabs(path) or os.path.commonpath([root, real]) != root:
        raise MediaError("local image path is outside the allowed path", code="image_url_forbidden")
    try:
        # Only regular files: opening a FIFO or device could block or never end.
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise MediaError("local image path is not a regular file", code="invalid_image_url")
        with open(real, "rb") as f:
            data = f.read(policy.max_image_bytes + 1)
    except FileNotFoundError:
        raise MediaError("local image file not found", code="invalid_image_url") from None
    except OSError:
        raise MediaError("could not read local image file", code="invalid_image_url") from None
    if len(data) > policy.max_image_bytes:
        raise _too_large(policy)
    return data


# --- decoding helpers -------------------------------------------------------------------


def _exif_transpose(image: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(image)
    except Exception:
        # Malformed EXIF must not reject pixels that decoded fine; keep them as stored.
        return image.copy()


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode.startswith("I;16") or image.mode == "I":
        # 16-bit grayscale: Pillow's convert clips values above 255; scale to 8 bits.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        # Transparent pixels often hold arbitrary colour; show them as a browser would,
        # on white, rather than letting the model see the hidden colour (often black).
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")  # L, 1, P, CMYK, YCbCr, RGB (a copy)


def _too_large(policy: MediaPolicy) -> MediaError:
    return MediaError(
        f"image too large: more than {policy.max_image_bytes} bytes", code="image_too_large"
    )


def _too_many_pixels(width: int, height: int, policy: MediaPolicy) -> MediaError:
    return MediaError(
        f"image too large: {width}x{height} exceeds {policy.max_image_pixels} pixels",
        code="image_too_large",
    )
