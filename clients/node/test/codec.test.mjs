// The client's pure parts against the rules of proto/README.md: strict decoding, exactly-once stream assembly,
// affinity from engine stats. Run with `node --test test/` (tests/test_node_client.py does).

import assert from "node:assert/strict";
import { test } from "node:test";
import { decodeAs, encode, EngineDirectory, packIds, ProtoError, segmentParts, StreamAssembler, Subjects } from "../prorsa.mjs";

const bytes = (obj) => new TextEncoder().encode(JSON.stringify(obj));
const chunk = (index, tokens, extra = {}) => ({
  type: "token_chunk",
  schema_version: 2,
  request_id: "t:0",
  index,
  token_ids: tokens,
  logprobs: tokens.map(() => -0.5),
  engine_id: "e1",
  ...extra,
});

test("decoding refuses another schema version, another type, a missing field and bytes that are not JSON", () => {
  assert.equal(decodeAs(bytes(chunk(0, [1])), "token_chunk", "s", ["request_id"]).index, 0);
  assert.throws(() => decodeAs(bytes({ ...chunk(0, [1]), schema_version: 1 }), "token_chunk", "s"), /schema version 1/);
  assert.throws(() => decodeAs(bytes(chunk(0, [1])), "engine_stats", "s"), /expected engine_stats/);
  assert.throws(() => decodeAs(bytes({ type: "token_chunk", schema_version: 2 }), "token_chunk", "s", ["index"]), ProtoError);
  assert.throws(() => decodeAs(new TextEncoder().encode("{nope"), "token_chunk", "s"), /not JSON/);
  const out = JSON.parse(new TextDecoder().decode(encode("turn_submitted", { traj_id: "t", turn: 0 })));
  assert.deepEqual(Object.keys(out).slice(0, 2), ["type", "schema_version"]);
});

test("a stream is read in index order once complete; duplicates and late chunks change nothing", () => {
  const a = new StreamAssembler("t:0");
  assert.equal(a.add(chunk(1, [3], { finished: true, finish_reason: "length", prefill_engine: "p0" })), null);
  const res = a.add(chunk(0, [1, 2]));
  assert.deepEqual(res.tokenIds, [1, 2, 3]);
  assert.equal(res.prefillEngine, "p0");
  assert.equal(a.add(chunk(0, [9])), null);
  assert.equal(a.duplicates, 1);
  assert.deepEqual(a.result.tokenIds, [1, 2, 3]);
});

test("index 0 from another engine restarts the stream (the first engine died, the work was redelivered)", () => {
  const a = new StreamAssembler("t:0");
  a.add(chunk(0, [1, 2]));
  a.add(chunk(1, [3]));
  a.add(chunk(0, [7], { engine_id: "e2" }));
  const res = a.add(chunk(1, [8], { engine_id: "e2", finished: true }));
  assert.deepEqual(res.tokenIds, [7, 8]);
  assert.equal(res.restarts, 1);
});

test("affinity only to an engine with fresh stats, a prefill-capable role, not switching, a short queue", () => {
  const d = new EngineDirectory();
  const stats = (id, extra = {}) => ({ engine_id: id, ts_s: 10, role: "mixed", waiting: 0, switching: false, ...extra });
  d.observe(stats("a"), 0);
  d.observe(stats("b", { role: "decode" }), 0);
  d.observe(stats("c", { switching: true }), 0);
  d.observe(stats("d", { waiting: 9 }), 0);
  assert.equal(d.affinityTarget("a", 1000), "a");
  assert.equal(d.affinityTarget("a", 4000), null); // stale after 3 s
  for (const id of ["b", "c", "d", "unknown"]) assert.equal(d.affinityTarget(id, 1000), null);
  d.observe(stats("a", { ts_s: 9, role: "decode" }), 1000); // reordered: older than what we hold
  assert.equal(d.affinityTarget("a", 1500), "a");
  assert.equal(new Subjects("my-ns").workStream, "MY_NS_WORK");
  assert.throws(() => new Subjects("a.b"), /invalid namespace/);
});

test("a context-log segment is 32-bit little-endian ids in parts under max_payload, as proto/README.md says", () => {
  assert.deepEqual([...packIds([1, 258, 4294967295])], [1, 0, 0, 0, 2, 1, 0, 0, 255, 255, 255, 255]);
  assert.throws(() => packIds([-1]), /not in 0..2\^32-1/);
  const parts = segmentParts(3, 40, Array.from({ length: 600 }, (_, i) => i), 2048); // 256 ids a part
  assert.deepEqual(parts.map((p) => p.headers["Prorsa-Part"]), ["0/3", "1/3", "2/3"]);
  assert.equal(parts[0].headers["Prorsa-Prefix-Len"], "40");
  assert.equal(parts[2].body.length, (600 - 512) * 4);
  assert.equal(new Subjects().context("t-1", 4), "prorsa.ctx.t-1.4");
});
