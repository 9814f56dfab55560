"""The sampling a trainer sets, through the gateway to simulated engines, driven by the official OpenAI client and
raw HTTP: penalties, min_tokens, top-k logprobs and logprobs_mode are honoured (no 400), the top-k alternatives come
back on chat, completions, streamed chunks and /generate exactly as the engines drew them (a simulated engine's
alternatives are a pure function of request id and position), and what is still not honoured is a 400 naming the
field. A real nats-server, a prefill and a decode engine (so the first token's alternatives travel in the handoff),
and the gateway process with the tiny chat tokenizer."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from services.engine_agent.backends.sim_tokens import SimTokens
from tests.gateway_support import errors

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers", reason="the chat template needs transformers")

pytestmark = pytest.mark.timeout(180)


def _expected_top(request_id: str, n: int, k: int) -> list[list[tuple[int, float]]]:
    tokens = SimTokens(request_id)
    return [tokens.top(i, k) for i in range(n)]


async def test_chat_honours_penalties_min_tokens_and_top_logprobs(sim_gateway: str) -> None:
    client = openai.AsyncOpenAI(base_url=sim_gateway, api_key="none")
    r = await client.chat.completions.create(
        model="prorsa",
        messages=[{"role": "user", "content": "list the files"}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 8, "logprobs_mode": "processed_logprobs"},
        extra_headers={"X-Prorsa-Trajectory": "samp-chat-1"},
    )
    choice = r.model_dump()["choices"][0]
    ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert len(ids) == 8 and choice["finish_reason"] == "length"
    # The first token's alternatives came from the prefill engine, in the handoff.
    want = _expected_top("samp-chat-1:0", 8, 3)
    got = [[(alt["token_id"], alt["logprob"]) for alt in entry["top_logprobs"]] for entry in content]
    assert got == [[(t, pytest.approx(lp)) for t, lp in alts] for alts in want]
    for tok, entry in zip(ids, content, strict=True):
        assert entry["token_id"] == tok and len(entry["top_logprobs"]) == 3
        lps = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-9
        # The most likely listed is at least as likely as the sampled token.
        assert entry["logprob"] <= lps[0] + 1e-12
        # The sampled token is listed exactly when it ranks within the k.
        assert (entry["logprob"] >= lps[-1]) == any(alt["token_id"] == tok for alt in entry["top_logprobs"])
    await client.close()


async def test_completions_stream_and_generate_return_top_k(sim_gateway: str) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        comp = await http.post(
            f"{sim_gateway}/completions",
            json={"prompt": [5, 6, 7, 8], "max_tokens": 5, "logprobs": 2, "trajectory_id": "samp-comp-1"},
        )
        assert comp.status_code == 200, comp.text
        lp = comp.json()["choices"][0]["logprobs"]
        want = _expected_top("samp-comp-1:0", 5, 2)
        assert [[(t, x) for t, x in pos] for pos in lp["top_token_ids"]] == [
            [(t, pytest.approx(x)) for t, x in alts] for alts in want
        ]
        assert len(lp["top_logprobs"]) == 5 and all(len(d) <= 2 for d in lp["top_logprobs"])

        body = {
            "model": "prorsa",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "logprobs": True,
            "top_logprobs": 4,
            "stream": True,
            "trajectory_id": "samp-stream-1",
        }
        streamed: list[list[tuple[int, float]]] = []
        async with http.stream("POST", f"{sim_gateway}/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    for entry in (c.get("logprobs") or {}).get("content") or []:
                        streamed.append([(a["token_id"], a["logprob"]) for a in entry["top_logprobs"]])
        assert streamed == [
            [(t, pytest.approx(x)) for t, x in a] for a in _expected_top("samp-stream-1:0", 6, 4)
        ]

        gen = await http.post(
            f"{sim_gateway.removesuffix('/v1')}/generate",
            json={
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 2, "repetition_penalty": 1.1},
                "return_logprob": True,
                "top_logprobs_num": 2,
                "trajectory_id": "samp-gen-1",
            },
        )
        assert gen.status_code == 200, gen.text
        meta = gen.json()["meta_info"]
        want = _expected_top("samp-gen-1:0", 4, 2)
        assert [[(t, lp) for lp, t, _ in pos] for pos in meta["output_top_logprobs"]] == [
            [(t, pytest.approx(lp)) for t, lp in alts] for alts in want
        ]


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("chat/completions", {"min_p": 0.1}, "min_p"),
        ("chat/completions", {"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ("chat/completions", {"presence_penalty": 3.0}, "presence_penalty"),
        ("chat/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_what_is_still_not_honoured_is_a_400_naming_the_field(
    gateway_process: str, endpoint: str, body: dict, param: str
) -> None:
    base = (
        {"messages": [{"role": "user", "content": "x"}]}
        if endpoint.startswith("chat")
        else {"prompt": [1, 2]}
    )
    before = errors(gateway_process, "unsupported_field")
    r = httpx.post(f"{gateway_process}/{endpoint}", json={**base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert errors(gateway_process, "unsupported_field") == before + 1  # counted


async def test_a_refused_request_opens_no_session_and_uses_no_turn(sim_gateway: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{sim_gateway}/completions", json={"prompt": [1], "min_p": 0.5, "trajectory_id": "x-1"}
        )
        assert r.status_code == 400
        await asyncio.sleep(0.5)
        ok = await http.post(
            f"{sim_gateway}/completions", json={"prompt": [1], "max_tokens": 1, "trajectory_id": "x-1"}
        )
        # The refusal used no turn: the session's first turn is still turn 0.
        assert ok.status_code == 200 and ok.json()["choices"][0]["prorsa"]["turn"] == 0
