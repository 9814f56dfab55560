"""The engine agent's job decisions (services/engine_agent/job_core.py): exactly-once rules as pure values."""

from __future__ import annotations

from proto import DecodeHandoff, GenerateRequest, SamplingParams, Subjects
from services.engine_agent.job_core import (
    MAX_DELIVERIES_ON_ERROR,
    Ack,
    Adopt,
    Fail,
    JobCore,
    Nak,
    Publish,
    Start,
)
from services.engine_agent.jobs import Job

SUBJECTS = Subjects("t")


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        traj_id="t1",
        turn=0,
        prompt_token_ids=[1, 2, 3],
        prompt_len=3,
        sampling=SamplingParams(max_tokens=8),
        reply_to="_INBOX.x",
    )


def job(streamed: list[int] | None = None, handoff: bool = False) -> Job:
    req = request()
    h = DecodeHandoff(request=req, prefill_engine="p", first_token_id=5) if handoff else None
    j = Job(
        kind="decode" if handoff else "generate",
        request=req,
        msg=None,
        stream_seq=7,
        expected_tokens=8,
        pulled_wall_s=0.0,
        pulled_mono=0.0,
        handoff=h,
    )
    j.streamed_ids.extend(streamed or [])
    return j


def test_admission_starts_new_work_and_answers_bad_requests() -> None:
    core = JobCore()
    assert core.admit("r1", 7, None, "") == Start()
    assert core.admit("r1", 7, None, "prompt too long") == Fail("invalid_request", "prompt too long")


def test_a_redelivery_of_done_work_is_acked_without_running_it_again() -> None:
    core = JobCore()
    assert core.completed("r1", 7) == Ack()
    assert core.admit("r1", 7, None, "") == Ack()
    # the same request from another message (a client retry after the first finished) is new work
    assert core.admit("r1", 8, None, "") == Start()


def test_a_message_for_a_running_request_is_adopted_or_put_back() -> None:
    core = JobCore()
    assert core.admit("r1", 7, 7, "") == Adopt()  # its own message redelivered: ack the newest delivery
    assert core.admit("r1", 9, 7, "") == Nak()  # a client retry: after the running one


def test_the_done_memory_is_bounded_and_forgets_the_oldest() -> None:
    core = JobCore(max_done=2)
    for seq in (1, 2, 3):
        core.completed("r", seq)
    assert not core.done("r", 1) and core.done("r", 2) and core.done("r", 3)


def test_hand_on_requeues_untouched_work_and_migrates_streamed_work() -> None:
    untouched = JobCore.hand_on(job(), SUBJECTS)
    assert isinstance(untouched, Publish) and untouched.outcome == "requeued"
    assert untouched.subject == SUBJECTS.prefill_work_any and untouched.message == request()
    handoff = JobCore.hand_on(job(handoff=True), SUBJECTS)
    assert handoff.subject == SUBJECTS.decode_work_any and isinstance(handoff.message, DecodeHandoff)
    # a handoff whose KV is gone goes back to prefill
    lost = JobCore.hand_on(job(handoff=True), SUBJECTS, to_prefill=True)
    assert lost.subject == SUBJECTS.prefill_work_any and isinstance(lost.message, GenerateRequest)
    moved = JobCore.hand_on(job(streamed=[4, 5]), SUBJECTS)
    assert moved.outcome == "migrated" and moved.subject == SUBJECTS.prefill_work_any
    assert isinstance(moved.message, GenerateRequest) and moved.message.resume_token_ids == [4, 5]
    assert moved.msg_id != untouched.msg_id  # distinct hand-ons are not de-duplicated away


def test_an_engine_error_is_redelivered_then_failed_for_good() -> None:
    for deliveries in range(1, MAX_DELIVERIES_ON_ERROR):
        assert JobCore.engine_error(deliveries, "boom") == Nak()
    assert JobCore.engine_error(MAX_DELIVERIES_ON_ERROR, "boom") == Fail("engine", "engine error: boom")
