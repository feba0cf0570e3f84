"""What one hostile server record can make a reader show: its free text stays one line of printable characters,
and the standalone dashboard's headline max length is not its word alone."""

from __future__ import annotations

from petals_chain.dashboard.source import merge_view
from petals_chain.swarm.records import ServerRecord


def _value(peer_id: str, **kw) -> dict:
    base = dict(peer_id=peer_id, state="online", memory_bytes=10_000_000, tau_p=0.01, start_block=0, num_blocks=2,
                slots_total=5, slots_free=5, public_name="honest", max_length=64)
    return ServerRecord(**{**base, **kw}).to_value()


def test_every_free_text_of_a_record_is_one_printable_line():
    """A bidi override in ``device`` reversed the rest of the server's row on the dashboard (public_name and
    load_error were cleaned, the other texts a server writes were not)."""
    odd = "gpu\u202e\nINFO fake\x1b[2J\u200b"
    texts = dict(version=odd, device=odd, dtype=odd, quant=odd, serving=odd)
    record = ServerRecord.from_value({**_value("QmX"), **texts, "models": ["a", odd]})
    for name in texts:
        assert getattr(record, name) == "gpu  INFO fake [2J ", name
    assert record.models == ["a", "gpu  INFO fake [2J "]
    plain = ServerRecord.from_value(_value("QmY", device="cuda:0", dtype="bfloat16", models=["m-1", "m_2"]))
    assert (plain.device, plain.dtype, plain.models) == ("cuda:0", "bfloat16", ["m-1", "m_2"])


def test_the_standalone_max_length_is_what_most_servers_announce():
    """Without a trusted summary the page showed the largest max_length any record claimed (2^40 from one)."""
    records = {f"Qm{i}": ServerRecord.from_value(_value(f"Qm{i}", max_length=256)) for i in range(3)}
    records["QmBad"] = ServerRecord.from_value(_value("QmBad", max_length=1 << 40))
    records["QmIdle"] = ServerRecord.from_value(_value("QmIdle", max_length=0))  # not assigned yet
    assert merge_view("p", records, None)["max_length"] == 256
    assert merge_view("p", {"QmIdle": records["QmIdle"]}, None)["max_length"] == 0
    assert merge_view("p", records, {"max_length": 512})["max_length"] == 512  # the orchestrator's word wins
