def test_a_lease_adopted_after_its_chains_id_was_pruned_takes_the_new_id():
    """A job ran on chain 'a' while KEPT_CHAIN_IDS plans left 'a' out (its id pruned); 'a' back, the job was adopted
    there with the old id: its chain's running leases counted 1 of its 2 jobs (and its steps were learnt under a
    forgotten id)."""
    import asyncio

    from petals_chain.model import Chain
    from petals_chain.orchestrator.dispatch import KEPT_CHAIN_IDS, DispatchJob, DispatchManager

    def chain(name):
        return Chain(servers=(name,), blocks=(4,), service_time=0.34, capacity=2, spans=((0, 4),))

    async def main():
        dm = DispatchManager(schedule="edf", steps_per_job=lambda: 17.0)
        dm.set_chains([chain("a")])
        lease = await dm.acquire(DispatchJob("j", expected_output=4))
        for i in range(KEPT_CHAIN_IDS + 1):
            dm.set_chains([chain(f"s{i}")])
        dm.set_chains([chain("a")])
        other = await dm.acquire(DispatchJob("k", expected_output=4))
        assert lease.chain_id == other.chain_id == dm.chain_ids[0]
        assert dm._running_by_chain == {dm.chain_ids[0]: {lease, other}}

    asyncio.run(main())
