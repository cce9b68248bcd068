"""Per sequence: the next token from its logits (grammar mask, temperature, top-p, its own seeded
generator) and the text it has made so far, released as it becomes final (stop strings cut it)."""
from __future__ import annotations

from typing import List, Optional

import numpy as np


GREEDY_BELOW = 1e-5     # a temperature this small is greedy (dividing by it would overflow to inf)


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: Optional[int]):
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(None if seed is None else int(seed) % 2**64)

    def pick(self, logits) -> int:
        """logits: (vocab,) float32 on the CPU (a numpy array), -inf where the grammar forbids."""
        row = np.asarray(logits)
        if self.temperature < GREEDY_BELOW:
            i = int(row.argmax())                        # a NaN wins numpy's argmax: refused below
            if not np.isfinite(row[i]):
                raise ValueError("the model gave no finite logit (all masked, or NaN)")
            return i
        x = row.astype(np.float64)
        if np.isnan(x).any() or not np.isfinite(x).any():
            raise ValueError("the model gave no finite logit (all masked, or NaN)")
        p = np.exp((x - x.max()) / self.temperature)
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            ps = p[order] / p.sum()
            keep = order[(np.cumsum(ps) - ps) < self.top_p]  # the smallest prefix whose mass reaches top_p
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q
        cdf = np.cumsum(p)
        return int(min(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"), len(p) - 1))


class Grammar:
    """An llguidance matcher over the tokenizer's vocabulary: the tokens allowed next, and the
    constraint's end (it then allows only EOS)."""

    def __init__(self, lltok, grammar: str):
        import llguidance
        import llguidance.numpy as lln

        self._lln = lln
        self.m = llguidance.LLMatcher(lltok, grammar)
        if self.m.is_error():
            raise ValueError(self.m.get_error())
        self.mask = lln.allocate_token_bitmask(1, lltok.vocab_size)

    def apply(self, logits: np.ndarray) -> None:
        """Set the forbidden tokens' logits to -inf, in place (logits: a (vocab,) float32 array)."""
        self._lln.fill_next_token_bitmask(self.m, self.mask, 0)
        row = logits[None]
        n = self.mask.shape[1] * 32
        if row.shape[1] > n:
            row[:, n:] = float("-inf")
        self._lln.apply_token_bitmask_inplace(row[:, :n] if row.shape[1] > n else row, self.mask)

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise RuntimeError(f"grammar refused token {token}: {self.m.get_error()}")

    def done(self) -> bool:
        return self.m.is_stopped()


class TextOut:
    """Token ids -> text released as it is final: a trailing incomplete UTF-8 sequence waits for its
    next token, and so does a tail that could begin a stop string; a stop string ends the text.

    Decoding is incremental: each token decodes a short window (the tokens since the last final text,
    after the few before them, which give the tokenizer its spacing context), so a token costs the
    same at the end of a long reply as at its start."""

    def __init__(self, tokenizer, stop=()):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: List[int] = []
        self.context = 0        # ids[context:final] decoded: the text the window's decoding starts after
        self.final = 0          # ids[:final] are in self.text
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _decode_window(self, end: bool) -> None:
        before = self.tok.decode(self.ids[self.context:self.final], skip_special_tokens=True)
        window = self.tok.decode(self.ids[self.context:], skip_special_tokens=True)
        # an incomplete UTF-8 sequence decodes to U+FFFD (one, or one a byte with byte-fallback
        # tokenizers) and becomes other text once complete: it waits, unless this is the end
        if len(window) > len(before) and (end or not window.endswith("\ufffd")):
            self.text += window[len(before):]
            self.context, self.final = self.final, len(self.ids)

    def add(self, token: Optional[int]) -> str:
        """Append a token (None: the end) -> the text newly final."""
        if token is not None:
            self.ids.append(token)
        self._decode_window(end=token is None)
        text = self.text
        end = len(text)
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i != -1 and i < end:
                end, self.stopped = i, True
        if not self.stopped and token is not None:
            for s in self.stop:              # hold back a tail that may begin a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        out = text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out
