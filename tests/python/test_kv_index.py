"""The KV-event indexer (`rngd-kv-index`) against an INDEPENDENT publisher
written here from vLLM's published schema (`vllm_kv_events.py`, from `vllm/distributed/kv_events.py`
after vllm-project/vllm#42892: `EventBatch` array-like, each event a msgspec
struct tagged by `type`, encoded as a map) over pyzmq: a PUB socket sending
[topic, 8-byte big-endian sequence, msgpack batch] and a ROUTER replay socket
answering [identity, "", start_seq] with [identity, "", seq, payload]... then
[identity, "", -1, ""], as vLLM's `ZmqEventPublisher` does.

The indexer is the crate's `index_probe` example (subscribes to the endpoints
given in its JSON config, answers `match` / `match_all` / `stats` / `set`
lines with JSON). Covered: stored, removed, cleared, extra and unknown keys,
the old positional event form, a gap recovered by replay, a late join, a
sequence reset (publisher restart), an unknown parent (counted and reported
as no information, never 0), a failed replay, a silent stream, endpoint
removal, the block cap. Every wait polls a condition under a deadline.
"""

import json
import os
import subprocess
import threading
import time

import msgspec
import pytest
import zmq

from vllm_kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ENCODER = msgspec.msgpack.Encoder()


def stored(hashes, parent, tokens, block_size=4, **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=None, **kw)


def removed(hashes):
    return BlockRemoved(block_hashes=hashes, medium="GPU")


# --- the independent publisher ---------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher in a few lines: PUB + ROUTER replay (served by a
    thread that owns the ROUTER socket), a replay buffer of every batch."""

    def __init__(self, ctx, topic="kv@pod@model", pub_port=None, replay_port=None):
        self.topic = topic
        # An XPUB is a PUB on the wire (the subscriber cannot tell); it also
        # hands the test each subscription, so a test publishes live only
        # once the indexer is subscribed (no slow-joiner race).
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.subscriptions = 0
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self.pub, pub_port)
        self.replay_endpoint = self._bind(self.router, replay_port)
        self.lock = threading.Lock()
        self.buffer = []  # (seq, payload)
        self.next_seq = 0
        self.answer_replays = threading.Event()
        self.answer_replays.set()
        self.replays_served = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _bind(sock, port):
        if port is None:
            sock.bind("tcp://127.0.0.1:*")
        else:
            sock.bind(f"tcp://127.0.0.1:{port}")
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def spec(self, id):
        return {"id": id, "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic}

    def _serve(self):
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if not self.answer_replays.is_set():
                continue  # a replay socket that does not answer
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            with self.lock:
                batches = [b for b in self.buffer if b[0] >= start]
                self.replays_served += 1
            for seq, payload in batches:
                self.router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", END_SEQ, b""])

    def wait_subscribed(self, n=1, timeout=15):
        """Waits until `n` subscriptions reached the PUB socket in all."""
        deadline = time.monotonic() + timeout
        while self.subscriptions < n:
            assert time.monotonic() < deadline, "the indexer never subscribed"
            if self.pub.poll(50):
                msg = self.pub.recv()
                if msg[:1] == b"\x01":
                    self.subscriptions += 1

    def publish(self, *events, raw=None, send=True):
        """One batch (vLLM's structs, or `raw`: an already-built batch value);
        `send=False` keeps it for replay only (lost on the way)."""
        payload = ENCODER.encode(raw if raw is not None else KVEventBatch(time.time(), list(events), 0))
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self):
        """What a restarted vLLM looks like: an empty buffer, sequence from 0."""
        with self.lock:
            self.buffer = []
            self.next_seq = 0

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close()
        self.router.close()


# --- the indexer under test --------------------------------------------------------
def probe_bin():
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/rngd-pd/target")
    b = os.path.join(target, "release", "examples", "index_probe")
    if not os.path.isfile(b):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "rngd-kv-index",
                        "--example", "index_probe"], cwd=REPO, check=True)
    return b


class Probe:
    def __init__(self, endpoints, **options):
        options.setdefault("retry_after_ms", 100)
        cfg = {"options": options, "endpoints": endpoints}
        self.p = subprocess.Popen([probe_bin(), json.dumps(cfg)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert json.loads(self.p.stdout.readline()) == {"ready": True}

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def match(self, id, tokens):
        return self.ask("match " + " ".join(map(str, [id, *tokens])))["match"]

    def match_all(self, tokens):
        return self.ask("match_all " + " ".join(map(str, tokens)))["matches"]

    def stats(self, id=None):
        s = self.ask("stats")
        return s if id is None else s["endpoints"].get(id)

    def set(self, endpoints):
        return self.ask("set " + json.dumps(endpoints))

    def wait(self, what, cond, timeout=15):
        deadline = time.monotonic() + timeout
        while True:
            if cond():
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}; stats {self.stats()}"
            time.sleep(0.01)

    def wait_match(self, id, tokens, want):
        self.wait(f"match {id} == {want}", lambda: self.match(id, tokens) == want)

    def close(self):
        self.p.stdin.close()
        assert self.p.wait(timeout=30) == 0


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def pubs(ctx):
    made = []

    def make(**kw):
        p = Publisher(ctx, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def probes():
    made = []

    def make(endpoints, **options):
        p = Probe(endpoints, **options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def r(a, b):
    return list(range(a, b))


def test_stored_removed_cleared_and_lenient_decoding(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    ix.wait("live", lambda: ix.stats("w0")["health"] == "live")
    assert ix.match("w0", r(0, 12)) == 0, "live and empty: 0"
    pub.publish(stored([101, 102, 103], None, r(0, 12)))
    ix.wait_match("w0", r(0, 13), 12)
    # Engine hashes are opaque: a continuation through the parent's hash,
    # with vLLM's optional keys present (group_idx, spec kind).
    pub.publish(stored([104], 103, r(12, 16), group_idx=0, kv_cache_spec_kind="full_attention"))
    ix.wait_match("w0", r(0, 16), 16)
    pub.publish(removed([103, 104]))
    ix.wait_match("w0", r(0, 16), 8)
    # A raw batch: an unknown key in an event, an unknown event type (skipped
    # and counted), the old positional form of BlockStored.
    pub.publish(raw=[time.time(), [
        {"type": "BlockStored", "block_hashes": [201], "parent_block_hash": None,
         "token_ids": r(500, 504), "block_size": 4, "lora_id": None, "medium": "GPU",
         "lora_name": None, "a_future_key": [1, 2]},
        {"type": "SomethingNew", "x": 1},
        ["BlockStored", [301], None, r(700, 704), 4, None, "GPU"],
    ], 0])
    ix.wait_match("w0", r(700, 704), 4)
    assert ix.match("w0", r(500, 504)) == 4
    st = ix.stats("w0")
    assert st["undecodable"] == 1 and st["health"] == "live"
    # A LoRA adapter's blocks and a chain with other extra keys (multimodal
    # inputs) are not the base model's for these tokens: not indexed. A chain
    # whose first block carries one string (vLLM's cache_salt) is indexed
    # under that salt: an unsalted prompt of the same tokens does not match it.
    held = ix.stats("w0")["blocks"]
    pub.publish(BlockStored(block_hashes=[401], parent_block_hash=None, token_ids=r(900, 904),
                            block_size=4, lora_id=3, medium="GPU", lora_name="ad"),
                stored([402], None, r(950, 954), extra_keys=[("salt",)]),
                stored([403], None, r(980, 984), extra_keys=[("mm-hash", 7)]))
    ix.wait("ignored", lambda: ix.stats("w0")["ignored_blocks"] == 2)
    assert ix.stats("w0")["blocks"] == held + 1
    assert ix.match("w0", r(900, 904)) == 0 and ix.match("w0", r(950, 954)) == 0
    assert ix.match("w0", r(980, 984)) == 0
    pub.publish(AllBlocksCleared())
    ix.wait_match("w0", r(0, 16), 0)
    assert ix.match("w0", r(700, 704)) == 0
    st = ix.stats("w0")
    assert st["blocks"] == 0 and st["gaps"] == 0 and st["unknown_parents"] == 0
    assert st["batches"] == 6


def test_a_gap_is_recovered_by_replay(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    ix.wait("live", lambda: ix.stats("w0")["health"] == "live")
    pub.publish(stored([1], None, r(0, 4)))
    ix.wait_match("w0", r(0, 12), 4)
    pub.publish(stored([2], 1, r(4, 8)), send=False)  # lost on the way
    pub.publish(stored([3], 2, r(8, 12)))
    ix.wait_match("w0", r(0, 12), 12)
    st = ix.stats("w0")
    assert st["gaps"] == 1 and st["replays"] >= 2 and st["unknown_parents"] == 0
    assert st["batches"] == 3 and st["health"] == "live"


def test_a_late_join_replays_from_0(pubs, probes):
    pub = pubs()
    pub.publish(stored([1, 2], None, r(0, 8)))
    pub.publish(stored([3], 2, r(8, 12)))
    pub.publish(removed([3]), stored([9], None, r(40, 44)))
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    ix.wait_match("w0", r(0, 12), 8)
    assert ix.match("w0", r(40, 44)) == 4
    assert ix.stats("w0")["batches"] == 3
    # Live batches go on after the replay, in order.
    pub.publish(stored([4], 2, r(8, 12)))
    ix.wait_match("w0", r(0, 12), 12)


def test_a_first_live_batch_past_0_replays_from_0(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    ix.wait("live", lambda: ix.stats("w0")["health"] == "live")  # empty publisher
    replays = ix.stats("w0")["replays"]
    pub.publish(stored([1], None, r(0, 4)), send=False)  # batch 0 never seen live
    pub.publish(stored([2], 1, r(4, 8)))  # the first batch seen is 1
    ix.wait_match("w0", r(0, 8), 8)
    st = ix.stats("w0")
    assert st["gaps"] == 1 and st["replays"] == replays + 1 and st["unknown_parents"] == 0


def test_a_subscription_whose_first_replay_fails_is_retried(pubs, probes):
    pub = pubs()
    pub.answer_replays.clear()  # the replay at subscription gets no answer
    pub.publish(stored([1], None, r(0, 4)))
    ix = probes([pub.spec("w0")], replay_timeout_ms=200)
    pub.wait_subscribed()
    ix.wait("the failed replay", lambda: ix.stats("w0")["replay_failures"] >= 1)
    assert ix.match("w0", r(0, 4)) is None, "no history yet: no information, not 0"
    assert ix.stats("w0")["health"] == "missed_batches"
    pub.answer_replays.set()
    pub.publish(stored([2], 1, r(4, 8)))
    ix.wait_match("w0", r(0, 8), 8)


def test_a_sequence_reset_clears_the_endpoint_and_replays(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    for i in range(3):
        pub.publish(stored([100 + i], None, r(10 * i, 10 * i + 4)))
    ix.wait_match("w0", r(20, 24), 4)
    pub.restart()
    pub.publish(stored([500], None, r(1000, 1004)))  # sequence 0 again
    ix.wait_match("w0", r(1000, 1004), 4)
    assert ix.match("w0", r(0, 4)) == 0 and ix.match("w0", r(20, 24)) == 0
    st = ix.stats("w0")
    assert st["restarts"] >= 1 and st["blocks"] == 1 and st["health"] == "live"


def test_an_unknown_parent_is_counted_and_reported_as_no_information(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")])
    pub.wait_subscribed()
    pub.publish(stored([1], None, r(0, 4)))
    ix.wait_match("w0", r(0, 4), 4)
    pub.publish(stored([7], 123456789, r(4, 8)))
    ix.wait("unknown parent", lambda: ix.stats("w0")["unknown_parents"] >= 1)
    assert ix.match("w0", r(0, 4)) is None, "no cache information, never 0"
    assert ix.match_all(r(0, 4)) == {"w0": None}
    assert ix.stats("w0")["health"] == "unknown_parent"
    # The recovery replay brings the same history back: still no information.
    n = pub.replays_served
    ix.wait("a recovery replay", lambda: pub.replays_served > n)
    assert ix.match("w0", r(0, 4)) is None
    # A reset makes the state known again.
    pub.publish(AllBlocksCleared(), stored([1], None, r(0, 4)))
    ix.wait_match("w0", r(0, 4), 4)


def test_a_gap_without_an_answering_replay_leaves_no_information(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")], replay_timeout_ms=200)
    pub.wait_subscribed()
    pub.publish(stored([1], None, r(0, 4)))
    ix.wait_match("w0", r(0, 4), 4)
    pub.answer_replays.clear()
    pub.publish(stored([2], 1, r(4, 8)), send=False)
    pub.publish(stored([3], 2, r(8, 12)))
    ix.wait("the failed replay", lambda: ix.stats("w0")["replay_failures"] >= 1)
    assert ix.match("w0", r(0, 12)) is None
    assert ix.stats("w0")["health"] == "missed_batches"
    pub.answer_replays.set()  # the rebuild (retried) succeeds
    ix.wait_match("w0", r(0, 12), 12)


def test_a_silent_stream_is_probed_and_marked_stale(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")], stale_after_ms=300, replay_timeout_ms=200)
    pub.wait_subscribed()
    pub.publish(stored([1], None, r(0, 4)))
    ix.wait_match("w0", r(0, 4), 4)
    # Silent but alive: the probe answers, the information stays.
    n = pub.replays_served
    ix.wait("a probe", lambda: pub.replays_served > n + 1)
    assert ix.match("w0", r(0, 4)) == 4
    # Silent and not answering: stale, no information.
    pub.answer_replays.clear()
    ix.wait("stale", lambda: ix.stats("w0")["health"] == "stale")
    assert ix.match("w0", r(0, 4)) is None
    assert ix.stats("w0")["stale"] >= 1
    # A batch brings it back.
    pub.publish(stored([2], 1, r(4, 8)))
    ix.wait_match("w0", r(0, 8), 8)


def test_a_removed_endpoint_is_forgotten(pubs, probes):
    a, b = pubs(), pubs()
    ix = probes([a.spec("a"), b.spec("b")])
    a.wait_subscribed()
    b.wait_subscribed()
    a.publish(stored([1], None, r(0, 4)))
    b.publish(stored([1, 2], None, r(0, 8)))
    ix.wait("both", lambda: ix.match_all(r(0, 8)) == {"a": 4, "b": 8})
    assert ix.set([a.spec("a")]) == {"ok": True}
    assert ix.match("b", r(0, 8)) is None
    s = ix.stats()
    assert list(s["endpoints"]) == ["a"] and s["total"]["blocks"] == 1
    b.publish(stored([3], 2, r(8, 12)))
    a.publish(stored([2], 1, r(4, 8)))
    ix.wait_match("a", r(0, 8), 8)
    assert ix.stats()["total"]["blocks"] == 2


def test_the_block_cap_bounds_the_index(pubs, probes):
    pub = pubs()
    ix = probes([pub.spec("w0")], max_blocks=6)
    pub.wait_subscribed()
    for c in range(4):
        base = 100 * c
        pub.publish(stored([base + 1, base + 2, base + 3], None, r(base, base + 12)))
    ix.wait("12 blocks seen", lambda: ix.stats("w0")["blocks_indexed"] == 12)
    st = ix.stats("w0")
    assert st["blocks"] == 6 and st["evicted"] == 6
    assert ix.stats()["total"]["blocks"] == 6
    # The newest chains whole, the oldest gone (chains go from their tails).
    assert ix.match("w0", r(300, 312)) == 12
    assert ix.match("w0", r(200, 212)) == 12
    assert ix.match("w0", r(100, 112)) == 0
    assert ix.match("w0", r(0, 12)) == 0
    # A child of an evicted block is not an unknown parent.
    pub.publish(stored([4], 3, r(12, 16)))
    ix.wait("the batch", lambda: ix.stats("w0")["batches"] == 5)
    assert ix.stats("w0")["unknown_parents"] == 0 and ix.stats("w0")["health"] == "live"
