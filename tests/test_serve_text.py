"""The reply's text as tokens arrive (zeroedge.serve.output.TextOut), on SmolLM2's real tokenizer:
what it releases adds up to the tokenizer's decoding of all the tokens, cut at a stop string, with
no incomplete character released early, and each token decodes a short window, not the reply."""
import random

import pytest

TEXTS = ["Hello, world! Ça va? 日本語のテキスト 🚀🎉 naïve café — “quotes” ∑ x² ",
         "def f(x):\n    return x**2  # 😀\n", "Ünïcödé ščř 中文 😀😀 end."]


def _stream(tok, ids, stop):
    from zeroedge.serve.output import TextOut

    out, pieces = TextOut(tok, stop), []
    for i in ids:
        pieces.append(out.add(i))
        if out.stopped:
            break
    else:
        pieces.append(out.add(None))
    return pieces


@pytest.mark.parametrize("seed", range(4))
def test_released_text_is_the_whole_decoding_cut_at_a_stop(smol_tok, seed):
    rng = random.Random(seed)
    for trial in range(60):
        if trial % 3:
            ids = smol_tok.encode(rng.choice(TEXTS) * rng.randint(1, 3), add_special_tokens=False)
        else:                                     # any tokens at all: split characters, specials
            ids = [rng.randrange(len(smol_tok)) for _ in range(rng.randint(1, 60))]
        stop = rng.choice([[], ["😀"], ["ld!"], [" end"], ["\n    "]])
        pieces = _stream(smol_tok, ids, stop)
        whole = smol_tok.decode(ids, skip_special_tokens=True)
        cut = whole.find(stop[0]) if stop else -1
        assert "".join(pieces) == (whole[:cut] if cut != -1 else whole), (ids, stop)
        assert not any("\ufffd" in p for p in pieces[:-1]) or "\ufffd" in whole   # nothing half-made early


def test_a_token_decodes_a_short_window_late_in_a_long_reply(smol_tok):
    """Each token decodes the tokens since the last final text and a few before them, never the whole
    reply (re-decoding it all made a token's cost grow with the reply)."""
    from zeroedge.serve.output import TextOut

    class Counting:                                  # the real tokenizer, its decode calls measured
        def __init__(self, tok):
            self.tok, self.longest = tok, 0

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.tok.decode(ids, **kw)

    ids = smol_tok.encode(" ".join(TEXTS) * 200, add_special_tokens=False)[:4000]
    tok = Counting(smol_tok)
    out = TextOut(tok, ["zzz"])
    text = "".join(out.add(i) for i in ids) + out.add(None)
    assert text == smol_tok.decode(ids, skip_special_tokens=True)
    assert tok.longest <= 16, tok.longest
