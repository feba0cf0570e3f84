"""``n > 1``: a choice that fails cancels its siblings at once and every chain and server slot is released (an
in-process orchestrator with a real server process on loopback)."""

from __future__ import annotations

import time

import pytest

from petals_chain.swarm.local import memory_for

pytestmark = pytest.mark.slow

MAX_LENGTH = 64


def test_failing_choice_cancels_siblings_and_releases_chains(tiny_model_factory, tmp_path, scaled):
    from inprocess import InProcessSwarm

    from petals_chain.orchestrator.sampling import SamplingParams

    model = tiny_model_factory("llama", num_layers=4)
    sw = InProcessSwarm(model, tmp_path, max_length=MAX_LENGTH, arrival_rate=1.0)
    try:
        sw.start()
        # One chain, 4 jobs at once; 10 ms per decoded token per block (emulated), so that a sibling needs ~2 s for
        # its 50 tokens: the choices run as separate tasks, and on a loaded machine one ran 48 tokens ahead of
        # another (~0.25 s at full speed) and finished before choice 1 failed.
        sw.add_server("whole", memory_for(model, MAX_LENGTH, 4, 4), "--emulate-decode-ms", "10")
        sw.wait_until(lambda st: st["ready"] and st["chains"][0]["capacity"] >= 3, scaled(120), "the chain")

        class Boom(Exception):
            pass

        emitted: dict[int, int] = {0: 0, 1: 0, 2: 0}

        def emit_for(i):
            async def emit(text, choices):
                emitted[i] += len(choices)
                if i == 1 and emitted[1] >= 2:
                    raise Boom("the client of choice 1 went away")
            return emit

        max_tokens = 50
        params = [SamplingParams(temperature=0.8, seed=s, max_tokens=max_tokens, ignore_eos=True) for s in range(3)]
        with pytest.raises(Boom):
            sw.call(lambda orch: orch.generate_n([1, 2, 3, 4, 5], params, True, [emit_for(i) for i in range(3)]),
                    timeout=scaled(120))

        def released(orch_state) -> bool:
            return sw.orch.dispatch.running == 0 and all(ch["active"] == 0 for ch in orch_state["chains"])

        st = sw.wait_until(released, scaled(10), "every chain released")
        peer = st["chains"][0]["servers"][0]

        async def slots(orch):
            return await orch.client.info(peer)

        deadline = time.monotonic() + scaled(10)
        while (info := sw.call(slots))["slots_free"] != info["slots_total"] and time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"tokens emitted per choice before the cancel: {emitted}; server slots {info['slots_free']}/"
              f"{info['slots_total']}")
        assert info["slots_free"] == info["slots_total"]  # the siblings' server sessions were closed
        assert emitted[0] < max_tokens and emitted[2] < max_tokens  # cancelled, not run to the end
        # one failed job (the choice that raised); its two siblings, cancelled because of it, count cancelled
        assert (sw.orch.stats.failed, sw.orch.stats.cancelled) == (1, 2)
    finally:
        sw.stop()
