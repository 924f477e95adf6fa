"""The row values the bad-input suite feeds every per-row reader (`tests/integration/test_bad_row_values.py`,
and `jobs/measurements/fuzz_row_values.py` on any checkout): numbers past every range, NaN and infinities as numbers
and as text, wrong JSON types, nesting, lone surrogates, long text. Imports nothing of the package, so
it serves a checkout from before the readers it tests."""

from __future__ import annotations

import random

HUGE = int("9" * 400)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(cid, url=COMPLETIONS, **body):
    body = {"prompt": "the licence shall grant", **body} if url == COMPLETIONS else \
        {"messages": [{"role": "user", "content": "the licence"}], **body}
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def values(rng: random.Random) -> list:
    scalars = [HUGE, -HUGE, 2**63, -(2**63) - 1, 2**63 - 1, 10**5000, 1e308, -1e308, 5e-324, float("nan"),
               float("inf"), -float("inf"), 0, -1, 1, 0.5, 1.5, True, False, None, "", "NaN", "inf", "0.7",
               "\udcff", "x" * 10_000, [], {}, [HUGE], {"a": [1, {"b": None}]}, [1, 2], ["a", "b"], ["a", 1]]
    out = list(scalars)
    for _ in range(200):
        out.append(rng.choice([rng.randint(-(2**70), 2**70), rng.uniform(-1e6, 1e6), rng.random(),
                               [rng.choice(scalars)], {"k": rng.choice(scalars)}, str(rng.random())]))
    return out
