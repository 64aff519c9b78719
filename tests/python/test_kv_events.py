"""An independent consumer of the worker's KV events, written from vLLM's
published schema (`vllm/distributed/kv_events.py` after
vllm-project/vllm#42892: `EventBatch` array-like, each event a msgspec struct
tagged by `type` and encoded as a map), decoding exactly as vLLM's own
subscriber does (`msgspec.msgpack.Decoder(type=KVEventBatch)`) over pyzmq.

The publisher is `rngd-kv-events`'s `scripted_publisher` example (the crate's
real publisher, driven line by line), bound on loopback ports it picks
(`tcp://127.0.0.1:*`) and reports. The consumer checks BlockStored token ids
and an unbroken parent chain, BlockRemoved, AllBlocksCleared, sequence
numbers one apart, a deliberately dropped batch recovered through the replay
socket, and a subscriber that joins late recovering everything by replay.
"""

import json
import os
import subprocess

import msgspec
import pytest
import zmq

from vllm_kv_events import DECODER, END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPIC = "kv@test-pod@SmolLM2-135M-Instruct"




# --- the publisher under test --------------------------------------------------
def publisher_bin():
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.expanduser("~/.cache/rngd-pd/target")
    b = os.path.join(target, "release", "examples", "scripted_publisher")
    if not os.path.isfile(b):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "rngd-kv-events",
                        "--example", "scripted_publisher"], cwd=REPO, check=True)
    return b


class Publisher:
    def __init__(self, **config):
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
               "topic": TOPIC, "buffer_steps": 100, "hwm": 1000, **config}
        self.p = subprocess.Popen([publisher_bin(), json.dumps(cfg)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.endpoint = self._expect("pub ")
        self.replay_endpoint = self._expect("replay ")
        self.batches = 0

    def _expect(self, prefix):
        line = self.p.stdout.readline()
        assert line.startswith(prefix), f"publisher said {line!r}"
        return line[len(prefix):].strip()

    def send(self, *lines):
        for line in lines:
            self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def batch(self, *events):
        """Publishes `events` as one batch and waits until it went out."""
        self.send(*events, "end")
        self.batches += 1
        self.send(f"sync {self.batches}")
        assert self._expect("synced ") == str(self.batches)

    def close(self):
        self.p.stdin.close()
        assert self.p.wait(timeout=30) == 0


def stored(parent, block_size, hashes, tokens):
    p = "-" if parent is None else str(parent)
    return f"stored {p} {block_size} {','.join(map(str, hashes))} {','.join(map(str, tokens))}"


# --- the consumer ----------------------------------------------------------------
class Consumer:
    """A subscriber that processes batches in sequence order, fills gaps from
    the replay socket, and keeps the block index a router would."""

    def __init__(self, ctx, pub):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sub.connect(pub.endpoint)
        # A DEALER with REQ's envelope: a REQ socket would take only the
        # first reply of the replay stream.
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(pub.replay_endpoint)
        self.next_seq = 0
        self.processed = []  # (seq, payload bytes, decoded batch)
        self.replayed = []
        self.index = {}  # block hash -> its tokens
        self.drop_seqs = set()

    def recv_live(self, timeout_ms):
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == TOPIC.encode()
        assert len(seq) == 8
        return int.from_bytes(seq, "big"), payload

    def request_replay(self, start):
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(10_000), "replay did not answer"
            delimiter, seq, payload = self.replay.recv_multipart()
            assert delimiter == b""
            if seq == END_SEQ:
                assert payload == b"", "the end marker's payload is empty"
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def process(self, seq, payload):
        assert seq == self.next_seq, f"batch {seq} processed out of order (next {self.next_seq})"
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert e.medium == "GPU" and e.lora_id is None and e.lora_name is None
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                # An unbroken chain: the parent is known (or the chain starts a prompt).
                assert e.parent_block_hash is None or e.parent_block_hash in self.index, \
                    f"parent {e.parent_block_hash} unknown"
                for i, h in enumerate(e.block_hashes):
                    self.index[h] = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.index, f"removed unknown block {h}"
                    del self.index[h]
            else:
                assert isinstance(e, AllBlocksCleared)
                self.index.clear()
        self.processed.append((seq, payload, batch))
        self.next_seq = seq + 1

    def catch_up(self):
        """Processes what the replay socket has from the next sequence on."""
        for rseq, rpayload in self.request_replay(self.next_seq):
            if rseq == self.next_seq:
                self.replayed.append(rseq)
                self.process(rseq, rpayload)

    def consume_until(self, last_seq):
        while self.next_seq <= last_seq:
            got = self.recv_live(3_000)
            if got is None:
                # Nothing live: ZMQ drops what a PUB socket sends before a
                # new subscription has reached it (the slow joiner), so a
                # subscriber that joined as the batches went out catches up
                # by replay, as vLLM's consumers do.
                before = self.next_seq
                self.catch_up()
                assert self.next_seq > before, f"no batch after {before - 1}, live or replayed"
                continue
            seq, payload = got
            if seq in self.drop_seqs:
                self.drop_seqs.discard(seq)  # lost on the way (the test drops it)
                continue
            if seq < self.next_seq:
                continue  # already recovered by replay
            if seq > self.next_seq:
                self.catch_up()
            if seq == self.next_seq:
                self.process(seq, payload)


def script(pub):
    """The scripted cache history; returns the batches' expected events."""
    a = [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    pub.batch(stored(None, 4, [101, 102, 103], sum(a, [])))                   # 0: a prompt
    pub.batch(stored(103, 4, [104], [22, 23, 24, 25]))                        # 1: its next turn
    pub.batch(f"removed 104", stored(None, 4, [201], [900, 901, 902, 903]))   # 2: eviction + another prompt
    pub.batch(stored(201, 4, [202, 203], list(range(904, 912))))              # 3: its continuation
    pub.batch(f"removed 203,202")                                             # 4
    pub.batch("cleared")                                                      # 5: reset
    pub.batch(stored(None, 4, [301], [5, 6, 7, 8]))                           # 6: after the reset
    return 6


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_consumer_sees_the_cache_history_in_order_and_recovers_a_dropped_batch(ctx):
    pub = Publisher()
    try:
        c = Consumer(ctx, pub)
        c.drop_seqs = {2}
        last = script(pub)
        c.consume_until(last)
        seqs = [s for s, _, _ in c.processed]
        assert seqs == list(range(last + 1)), "every batch once, sequence numbers one apart"
        assert 2 in c.replayed, "the dropped batch came back through the replay socket"
        kinds = [[type(e).__name__ for e in b.events] for _, _, b in c.processed]
        assert kinds == [["BlockStored"], ["BlockStored"], ["BlockRemoved", "BlockStored"],
                         ["BlockStored"], ["BlockRemoved"], ["AllBlocksCleared"], ["BlockStored"]]
        first = c.processed[0][2].events[0]
        assert first.block_hashes == [101, 102, 103] and first.parent_block_hash is None
        assert first.token_ids == list(range(10, 22)) and first.block_size == 4
        assert c.processed[1][2].events[0].parent_block_hash == 103
        # After the reset only the new prompt's block is indexed.
        assert c.index == {301: [5, 6, 7, 8]}

        # The wire itself: [ts, [events…], rank], each event a map tagged by type.
        raw = msgspec.msgpack.decode(c.processed[2][1])
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
        assert raw[1][0] == {"type": "BlockRemoved", "block_hashes": [104], "medium": "GPU"}
        assert raw[1][1] == {"type": "BlockStored", "block_hashes": [201], "parent_block_hash": None,
                             "token_ids": [900, 901, 902, 903], "block_size": 4, "lora_id": None,
                             "medium": "GPU", "lora_name": None}

        # A subscriber that joins now gets nothing live and everything by replay.
        late = Consumer(ctx, pub)
        assert late.recv_live(200) is None
        for seq, payload in late.request_replay(0):
            late.process(seq, payload)
        assert [s for s, _, _ in late.processed] == seqs
        assert [p for _, p, _ in late.processed] == [p for _, p, _ in c.processed], \
            "replay sends the published bytes"
        assert late.index == c.index
        # From a later sequence: only what follows.
        assert [s for s, _ in late.request_replay(5)] == [5, 6]
        assert late.request_replay(last + 1) == []
    finally:
        pub.close()


def test_replay_serves_only_the_last_buffer_steps_batches(ctx):
    pub = Publisher(buffer_steps=3)
    try:
        for i in range(8):
            pub.batch(stored(None, 2, [1000 + i], [i, i]))
        c = Consumer(ctx, pub)
        assert [s for s, _ in c.request_replay(0)] == [5, 6, 7]
    finally:
        pub.close()


def test_an_unknown_config_key_is_refused_by_name():
    r = subprocess.run([publisher_bin(), json.dumps({"enable_kv_cache_events": True, "bufer_steps": 4})],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert "bufer_steps" in r.stderr
