"""What a job sends, built from its state (pure): chunks, the migration request, hand-on ids."""

from __future__ import annotations

from proto import GenerateRequest, SamplingParams
from services.engine_agent.jobs import Job, request_problem, valid_reply_subject
from services.engine_agent.outputs import error_chunk, hand_on_msg_id, migrated_request, token_chunk


def job(resume: list[int] | None = None, submitted_s: float = 100.0) -> Job:
    req = GenerateRequest(
        request_id="t:3",
        traj_id="t",
        turn=3,
        prompt_token_ids=[],
        prompt_len=500,
        sampling=SamplingParams(max_tokens=50),
        reply_to="prorsa.reply.c.3",
        affinity_engine="e-7",
        attempt=1,
        submitted_s=submitted_s,
        resume_token_ids=resume or [],
        next_chunk_index=4 if resume else 0,
    )
    return Job(
        kind="decode",
        request=req,
        msg=None,
        stream_seq=42,
        expected_tokens=50,
        pulled_wall_s=101.0,
        pulled_mono=1_000.0,
        next_index=req.next_chunk_index,
        prefill_engine="p-1",
    )


def test_a_migration_resumes_after_everything_streamed() -> None:
    j = job(resume=[1, 2, 3])
    j.streamed_ids = [4, 5]
    j.next_index = 7
    moved = migrated_request(j)
    assert (moved.request_id, moved.sampling.max_tokens, moved.attempt) == ("t:3", 50, 1)
    assert (moved.resume_token_ids, moved.next_chunk_index, moved.affinity_engine) == ([1, 2, 3, 4, 5], 7, "")
    assert hand_on_msg_id(j, moved) == "t:3#1:m5"
    assert hand_on_msg_id(j, None) == "t:3#1:q42"


def test_final_chunk_carries_totals_and_latencies() -> None:
    j = job()
    j.streamed_ids = [9] * 10
    j.cached_tokens = 300
    j.first_stream_mono = 1_000.5
    c = token_chunk(
        j,
        3,
        [9],
        [-0.1],
        engine_id="d-1",
        final=True,
        reason="stop",
        policy_version=6,
        now_s=103.0,
        now_mono=1_002.0,
    )
    assert (c.index, c.finished, c.finish_reason, c.output_tokens, c.cached_tokens, c.policy_version) == (
        3,
        True,
        "stop",
        10,
        300,
        6,
    )
    assert (c.ttft_s, c.e2e_s, c.prefill_engine, c.prompt_tokens) == (1.5, 3.0, "p-1", 500)
    middle = token_chunk(j, 1, [1, 2], [-0.5], engine_id="d-1")  # incomplete logprobs are dropped
    assert middle.logprobs is None and not middle.finished and middle.output_tokens == 0


def test_migrated_requests_report_no_ttft_and_errors_end_the_stream() -> None:
    j = job(resume=[1])
    j.first_stream_mono = 1_000.5
    assert token_chunk(j, 5, [], None, engine_id="d", final=True, now_s=103.0, now_mono=1_002.0).ttft_s == 0.0
    e = error_chunk(j.request, 4, "too long", "d")
    assert (e.index, e.finished, e.finish_reason, e.error, e.token_ids) == (4, True, "error", "too long", [])


def test_request_checks() -> None:
    assert request_problem(job().request, max_model_len=1_000) == ""
    assert "exceeds max_model_len 500" in request_problem(job().request, max_model_len=500)
    assert all(valid_reply_subject(s) for s in ("a", "prorsa.reply.c-1.3", "_INBOX.x"))
    assert not any(
        valid_reply_subject(s) for s in ("", "a..b", "a.*", "a.>", "a b", "$JS.API.X", "a.", "x" * 600)
    )
