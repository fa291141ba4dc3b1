"""Incremental text for one request: streaming detokenization plus stop strings.

Stop strings are matched across token boundaries and never emitted: text that could be
the start of a stop string is held back until the next token decides.
"""

from __future__ import annotations

import copy


class TextAssembler:
    def __init__(self, detokenizer, stop: list[str]):
        # mlx-lm's streaming detokenizers keep multi-byte characters whole.
        self._detok = copy.copy(detokenizer)
        self._detok.reset()
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def add_token(self, token: int) -> str:
        """Add a token; returns text that is now safe to emit."""
        self._detok.add_token(token)
        return self._release(self._detok.last_segment, final=False)

    def finish(self) -> str:
        """End of generation: flush everything still held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

    def _release(self, segment: str, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._pending + segment
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = 0 if final else self._held_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def _first_stop(self, text: str) -> int | None:
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self._stop) if i >= 0]
        if not hits:
            return None
        cut, self.stop_string = min(hits, key=lambda hit: hit[0])
        return cut

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


def make_detokenizer(model_path, tokenizer):
    """mlx-lm's streaming detokenizer for this tokenizer (BPE, SentencePiece, or the
    naive fallback), chosen from ``tokenizer.json`` as mlx-lm does it. These flush text
    as soon as it is complete, character by character, not word by word."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_lm.tokenizer_utils import load as load_lm_tokenizer

    try:
        return load_lm_tokenizer(model_path).detokenizer
    except Exception:  # noqa: BLE001 - any tokenizer still decodes naively
        return NaiveStreamingDetokenizer(tokenizer)
