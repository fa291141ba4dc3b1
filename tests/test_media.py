"""Tests for vlm_serve.preprocess.media: real image files built with Pillow, a real
local HTTP server, real files and symlinks on disk."""

from __future__ import annotations

import base64
import datetime
import io
import os
import random
import socket
import ssl
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from vlm_serve.preprocess import media, url_safety
from vlm_serve.preprocess.media import MediaError, MediaPolicy, image_digest, load_image

PRIVATE = MediaPolicy(allow_private_urls=True)  # the test server is on loopback


# --- image builders ----------------------------------------------------------------


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def noisy_png() -> bytes:
    """A PNG whose base64 has '+', '/' and '=' padding (so every variant is exercised)."""
    image = Image.frombytes("RGB", (16, 16), random.Random(0).randbytes(16 * 16 * 3))
    data = encode(image, "PNG")
    # Pillow ignores bytes after IEND; pad so the length is not a multiple of 3.
    return data + b"\0" * (1 if len(data) % 3 == 0 else 0)


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims the given size but holds almost no data (a bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


RED, BLUE = (255, 0, 0), (0, 0, 255)


def close(pixel, expected, tolerance=24) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, expected))


# --- data: URLs and decoding ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats_decode_to_rgb(fmt):
    image = load_image(data_url(encode(Image.new("RGB", (12, 8), RED), fmt)), MediaPolicy())
    assert image.mode == "RGB" and image.size == (12, 8)
    assert close(image.getpixel((3, 3)), RED)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animated_images_give_first_frame(fmt):
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), BLUE)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert getattr(Image.open(io.BytesIO(data)), "n_frames", 1) == 2
    image = load_image(data_url(data), MediaPolicy())
    assert close(image.getpixel((4, 4)), RED)
    assert getattr(image, "n_frames", 1) == 1


def test_base64_variants():
    data = noisy_png()
    padded = base64.b64encode(data).decode()
    assert padded.endswith("=") and "+" in padded and "/" in padded
    expected = image_digest(load_image(data_url(data), MediaPolicy()))
    wrapped = "\n".join(padded[i : i + 76] for i in range(0, len(padded), 76))
    variants = [
        "data:image/png;base64," + padded.rstrip("="),  # no padding
        "data:image/png;base64," + wrapped + "\n",  # MIME line breaks
        "data:image/png;base64, " + padded.replace("A", " A"),  # stray spaces
        "data:image/png;base64," + base64.urlsafe_b64encode(data).decode(),
        "data:image/png;base64," + base64.urlsafe_b64encode(data).decode().rstrip("="),
        # percent-encoded
        "data:image/png;base64," + padded.replace("+", "%2B").replace("/", "%2F"),
        "DATA:IMAGE/PNG;BASE64," + padded,
        "data:image/jpeg;base64," + padded,  # wrong mime: sniffed
        "data:text/plain;base64," + padded,
        "data:;base64," + padded,  # missing mime
        "data:base64," + padded,
        "  data:image/png;base64," + padded + "  ",
    ]
    for url in variants:
        assert image_digest(load_image(url, MediaPolicy())) == expected, url[:40]


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64", "missing ','"),
        ("data:image/png;base64,!!!!", "not valid base64"),
        ("data:image/png;base64,QUJDR", "not valid base64"),  # impossible length
        ("data:image/png;base64,ümlaut", "not valid base64"),
    ],
)
def test_bad_data_urls(url, message):
    with pytest.raises(MediaError, match=message) as info:
        load_image(url, MediaPolicy(), param="messages[0].content[1].image_url")
    assert info.value.param == "messages[0].content[1].image_url"
    assert info.value.code == "invalid_image_url"


def test_rgba_la_and_palette_transparency_composite_on_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (*RED, 255))
    image = load_image(data_url(encode(rgba, "PNG")), MediaPolicy())
    assert image.mode == "RGB"
    assert image.getpixel((1, 1)) == (255, 255, 255)  # transparent black shows as white
    assert image.getpixel((0, 0)) == RED

    la = Image.new("LA", (4, 4), (0, 0))
    image = load_image(data_url(encode(la, "PNG")), MediaPolicy())
    assert image.getpixel((0, 0)) == (255, 255, 255)

    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([0, 0, 0, *RED])  # index 0 black (transparent), 1 red
    palette.putpixel((0, 0), 1)
    image = load_image(data_url(encode(palette, "PNG", transparency=0)), MediaPolicy())
    assert image.getpixel((0, 0)) == RED and image.getpixel((2, 2)) == (255, 255, 255)


def test_palette_without_transparency():
    palette = Image.new("RGB", (6, 6), BLUE).convert("P")
    image = load_image(data_url(encode(palette, "PNG")), MediaPolicy())
    assert image.mode == "RGB" and image.getpixel((2, 2)) == BLUE


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), BLUE)
    image.paste(RED, (0, 0, 20, 20))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    loaded = load_image(data_url(encode(image, "JPEG", exif=exif.tobytes())), MediaPolicy())
    assert loaded.size == (20, 40)
    assert close(loaded.getpixel((10, 5)), RED)  # the left half is now on top
    assert close(loaded.getpixel((10, 35)), BLUE)


def test_cmyk_jpeg():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red in CMYK
    image = load_image(data_url(encode(cmyk, "JPEG")), MediaPolicy())
    assert image.mode == "RGB" and close(image.getpixel((4, 4)), RED)


def test_grayscale_and_16_bit():
    gray = load_image(data_url(encode(Image.new("L", (4, 4), 100), "PNG")), MediaPolicy())
    assert gray.getpixel((0, 0)) == (100, 100, 100)
    deep = Image.new("I;16", (4, 4), 32768)  # half of the 16-bit range
    assert load_image(data_url(encode(deep, "PNG")), MediaPolicy()).getpixel((0, 0)) == (128,) * 3


def test_pixel_limit_checked_before_decoding():
    # 7000x7000 is under Pillow's own bomb limit but over ours; 20000x20000 trips Pillow's.
    for side in (7000, 20000):
        with pytest.raises(MediaError, match="too many pixels|exceeds") as info:
            load_image(data_url(png_header(side, side)), MediaPolicy())
        assert info.value.code == "image_too_large"
    small = data_url(encode(Image.new("RGB", (20, 20)), "PNG"))
    with pytest.raises(MediaError, match="20x20 exceeds 100 pixels"):
        load_image(small, MediaPolicy(max_image_pixels=100))


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_pillow_bomb_warning_as_error_is_a_media_error():
    # 10000x10000 is between Pillow's warning and error limits; where warnings are
    # errors, Image.open raises the warning before our own check runs.
    with pytest.raises(MediaError, match="too many pixels") as info:
        load_image(data_url(png_header(10_000, 10_000)), MediaPolicy(max_image_pixels=200_000_000))
    assert info.value.code == "image_too_large"


def test_byte_limit():
    data = noisy_png()
    with pytest.raises(MediaError, match="image too large") as info:
        load_image(data_url(data), MediaPolicy(max_image_bytes=len(data) - 10))
    assert info.value.code == "image_too_large"
    assert load_image(data_url(data), MediaPolicy(max_image_bytes=len(data)))


@pytest.mark.parametrize(
    "data, message",
    [
        (encode(Image.new("RGB", (64, 64), RED), "PNG")[:60], "could not decode"),  # truncated
        (encode(Image.new("RGB", (64, 64), RED), "JPEG")[:200], "could not decode"),
        (b"hello, this is not an image", "not a supported image"),
        (b"", "not a supported image"),
        # EPS is refused: Pillow would hand it to Ghostscript
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not a supported image"),
    ],
)
def test_corrupt_and_non_image_bytes(data, message):
    with pytest.raises(MediaError, match=message) as info:
        load_image(data_url(data), MediaPolicy())
    assert info.value.code == "invalid_image"


@pytest.mark.parametrize(
    "url",
    [
        "", "   ", "ftp://example.com/a.png", "relative/a.png", "javascript:alert(1)",
        "http://", "https:///a.png", None, 42,
    ],
)
def test_unsupported_urls(url):
    with pytest.raises(MediaError) as info:
        load_image(url, MediaPolicy(), param="p")
    assert info.value.code == "invalid_image_url" and info.value.param == "p"


def test_digest_is_stable_and_content_sensitive():
    a = Image.new("RGB", (4, 4), RED)
    assert image_digest(a) == image_digest(a.copy())
    assert image_digest(a) != image_digest(Image.new("RGB", (4, 4), BLUE))
    assert image_digest(a) != image_digest(Image.new("RGB", (2, 8), RED))  # same bytes, other shape


# --- address checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1", "172.16.0.1", "192.168.1.1", "127.0.0.1", "169.254.169.254", "169.254.1.1",
        "0.0.0.0", "100.64.0.1", "224.0.0.1", "255.255.255.255", "240.0.0.1",
        "::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "fe80::1%eth0", "fec0::1", "ff02::1",
        "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1", "not-an-ip",
    ],
)
def test_private_addresses_refused(address):
    assert not url_safety.is_public_ip(address)


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_public_addresses_allowed(address):
    assert url_safety.is_public_ip(address)


# --- http(s) URLs --------------------------------------------------------------------

PNG = encode(Image.new("RGB", (10, 6), RED), "PNG")
SEEN_HOSTS: list[str] = []  # the Host header of every request the server got


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def send(self, status: int, body: bytes = b"", content_type: str = "image/png", **headers):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path
        SEEN_HOSTS.append(self.headers["Host"])
        if path == "/img.png":
            self.send(200, PNG)
        elif path.startswith("/redirect/"):  # /redirect/N: N more hops, then the image
            hops = int(path.rsplit("/", 1)[1])
            self.send(302, Location="/img.png" if hops == 0 else f"/redirect/{hops - 1}")
        elif path == "/redirect-private":
            self.send(302, Location="http://10.0.0.1/img.png")
        elif path == "/redirect-ftp":
            self.send(302, Location="ftp://example.com/img.png")
        elif path == "/slow":
            time.sleep(2)
            self.send(200, PNG)
        elif path == "/trickle":  # headers at once, then the body too slowly
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(40):
                self.wfile.write(b"x" * 10)
                self.wfile.flush()
                time.sleep(0.05)
        elif path == "/huge":  # declares its size
            self.send(200, b"\0" * 200_000)
        elif path == "/huge-undeclared":  # no Content-Length: read until close
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"\0" * 10_000)
        elif path == "/text":
            self.send(200, b"<html>not an image</html>", content_type="text/html")
        else:
            self.send(404, b"not found", content_type="text/plain")


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the client hangs up on purpose (byte cap, timeout): no traceback


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_fetch_image(server):
    image = load_image(f"{server}/img.png", PRIVATE)
    assert image.size == (10, 6) and image.getpixel((0, 0)) == RED


def test_redirects(server):
    assert load_image(f"{server}/redirect/2", PRIVATE).size == (10, 6)  # 3 hops: within 3
    with pytest.raises(MediaError, match="more than 3 redirects") as info:
        load_image(f"{server}/redirect/3", PRIVATE)
    assert info.value.code == "image_fetch_failed"
    with pytest.raises(MediaError, match="more than 0 redirects"):
        load_image(f"{server}/redirect/0", MediaPolicy(allow_private_urls=True, max_redirects=0))
    with pytest.raises(MediaError, match="http"):
        load_image(f"{server}/redirect-ftp", PRIVATE)


def test_timeout(server):
    policy = MediaPolicy(allow_private_urls=True, fetch_timeout_s=0.3)
    # A stalled server, and one that trickles bytes just inside the read timeout.
    for path in ("/slow", "/trickle"):
        start = time.monotonic()
        with pytest.raises(MediaError, match="timed out") as info:
            load_image(server + path, policy)
        assert info.value.code == "image_fetch_failed"
        assert time.monotonic() - start < 1.5


def test_http_errors(server):
    with pytest.raises(MediaError, match="HTTP 404") as info:
        load_image(f"{server}/missing.png", PRIVATE, param="p")
    assert (info.value.code, info.value.param) == ("image_fetch_failed", "p")
    with pytest.raises(MediaError, match="not a supported image"):
        load_image(f"{server}/text", PRIVATE)


def test_unreachable_host():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaError, match="could not fetch image") as info:
        load_image(f"http://127.0.0.1:{port}/img.png", PRIVATE)
    assert info.value.code == "image_fetch_failed"


def test_byte_cap_while_streaming(server):
    policy = MediaPolicy(allow_private_urls=True, max_image_bytes=50_000)
    for path in ("/huge", "/huge-undeclared"):
        with pytest.raises(MediaError, match="image too large") as info:
            load_image(server + path, policy)
        assert info.value.code == "image_too_large"


def test_loopback_refused_unless_allowed(server):
    port = server.rsplit(":", 1)[1]
    urls = [f"{server}/img.png", f"http://localhost:{port}/img.png", f"http://[::1]:{port}/img.png"]
    for url in urls:
        with pytest.raises(MediaError, match="private") as info:
            load_image(url, MediaPolicy())
        assert info.value.code == "image_url_forbidden"
    assert load_image(f"{server}/img.png", PRIVATE).size == (10, 6)


@pytest.fixture
def loopback_is_public(monkeypatch):
    """Pretend 127.0.0.1 is a public address, and "images.test" resolves to it.

    All test hosts are loopback, so this is how the checked (not private) path runs.
    """
    monkeypatch.setattr(url_safety, "is_public_ip", lambda a: a == "127.0.0.1")
    real_resolve = url_safety.resolve
    monkeypatch.setattr(
        url_safety, "resolve",
        lambda host, port: ["127.0.0.1"] if host == "images.test" else real_resolve(host, port),
    )


def test_connection_is_pinned_to_the_checked_address(server, loopback_is_public):
    # "images.test" does not resolve for real: the fetch only works because the
    # connection goes to the checked address, with the original Host header.
    port = server.rsplit(":", 1)[1]
    assert load_image(f"http://images.test:{port}/img.png", MediaPolicy()).size == (10, 6)
    assert SEEN_HOSTS[-1] == f"images.test:{port}"


def self_signed(hostname: str) -> tuple[bytes, bytes]:
    """A certificate for `hostname` and its key, both PEM."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_https_pinned_connection_keeps_server_name(tmp_path, monkeypatch, loopback_is_public):
    # The connection goes to 127.0.0.1, but TLS must still send and verify "images.test".
    cert, key = self_signed("images.test")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    httpd.socket = server_context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = httpd.server_address[1]
    try:
        monkeypatch.setattr(media, "_SSL_CONTEXT", ssl.create_default_context(cadata=cert.decode()))
        image = load_image(f"https://images.test:{port}/img.png", MediaPolicy())
        assert image.size == (10, 6)
        # Same server, another name: the certificate does not match, so the fetch fails.
        monkeypatch.setattr(url_safety, "resolve", lambda host, port: ["127.0.0.1"])
        with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED") as info:
            load_image(f"https://other.test:{port}/img.png", MediaPolicy())
        assert info.value.code == "image_fetch_failed"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_redirect_to_private_address_refused(server, loopback_is_public):
    with pytest.raises(MediaError, match="10.0.0.1 resolves to a private") as info:
        load_image(f"{server}/redirect-private", MediaPolicy())
    assert info.value.code == "image_url_forbidden"


def test_host_that_does_not_resolve(monkeypatch):
    def fail(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(url_safety, "resolve", fail)  # no DNS lookup: fast and offline
    with pytest.raises(MediaError, match="could not resolve") as info:
        load_image("http://no-such-host.invalid/a.png", MediaPolicy())
    assert info.value.code == "image_fetch_failed"


# --- local files ---------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a b.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (tmp_path / "allowed2").mkdir()
    (tmp_path / "allowed2" / "x.png").write_bytes(PNG)  # shares a prefix with "allowed"
    os.symlink(tmp_path / "secret.png", allowed / "escape.png")
    os.symlink(allowed / "sub" / "a b.png", allowed / "inside.png")
    return tmp_path, MediaPolicy(allowed_local_path=str(allowed))


def test_local_files_under_the_allowed_path(files):
    root, policy = files
    path = root / "allowed" / "sub" / "a b.png"
    assert load_image(str(path), policy).size == (10, 6)
    assert load_image(path.as_uri(), policy).size == (10, 6)  # file:///...a%20b.png
    assert load_image(f"file://localhost{path}", policy).size == (10, 6)
    assert load_image(str(root / "allowed" / "inside.png"), policy).size == (10, 6)


@pytest.mark.parametrize(
    "relative",
    ["secret.png", "allowed/escape.png", "allowed/../secret.png", "allowed2/x.png"],
)
def test_local_files_outside_the_allowed_path(files, relative):
    root, policy = files
    for url in (str(root / relative), f"file://{root / relative}"):
        with pytest.raises(MediaError, match="outside the allowed path") as info:
            load_image(url, policy)
        assert info.value.code == "image_url_forbidden"


def test_local_files_refused_without_a_configured_path(files):
    root, _ = files
    for url in (str(root / "allowed" / "sub" / "a b.png"), (root / "secret.png").as_uri()):
        with pytest.raises(MediaError, match="local media paths are not allowed"):
            load_image(url, MediaPolicy())


def test_local_file_errors(files):
    root, policy = files
    with pytest.raises(MediaError, match="not found"):
        load_image(str(root / "allowed" / "missing.png"), policy)
    with pytest.raises(MediaError, match="not a regular file"):
        load_image(str(root / "allowed" / "sub"), policy)
    with pytest.raises(MediaError, match="local path"):
        load_image(f"file://otherhost{root}/allowed/sub/x.png", policy)
    with pytest.raises(MediaError, match="image too large"):
        small = MediaPolicy(allowed_local_path=policy.allowed_local_path, max_image_bytes=10)
        load_image(str(root / "allowed" / "inside.png"), small)
