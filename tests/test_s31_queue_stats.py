"""The orchestrator's statistics: the prefix-cache hit rate counts its hits and their opens alike (it went past 1), and
the draft model's failures are exported in /metrics."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from petals_chain.orchestrator.stats import Stats


def _metric(stats: Stats, name: str) -> float:
    for line in generate_latest(stats.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_the_prompt_cache_hit_rate_counts_every_open_and_stays_within_one():
    """n = 3 over three chains whose servers hold 16 tokens of a 20-token prompt: each choice's open hit 16 tokens
    while the prompt counted 20 once, and the rate read 48 / 20 = 2.4 (reproduced through the API, the report's
    script). Counted per open (20 looked up each), it is 0.8; a failover's reopen on prompt + 6 generated tokens
    counts its own lookup, and an open that found nothing lowers the rate."""
    s = Stats()
    s.record(wait_s=0.0, service_s=0.1, tokens=2, prompt_tokens=20, ok=True)  # choice 0 counts the prompt
    for _ in range(3):
        s.add_chain_open(20, 16)
    assert s.prefix_json()["prompt_cache_hit_rate"] == 0.8 and s.prefix_json()["prefix_lookup_tokens"] == 60
    s.add_chain_open(26, 16)  # a failover's reopen
    s.add_chain_open(10, 0)  # an open with nothing cached
    relay = s.prefix_json()
    assert relay["prompt_cached_tokens"] == 64 and relay["prefix_hits"] == 4 and relay["prefix_lookup_tokens"] == 96
    assert 0 <= relay["prompt_cache_hit_rate"] <= 1 and abs(relay["prompt_cache_hit_rate"] - 64 / 96) < 1e-12
    assert _metric(s, "petals_chain_prefix_lookup_tokens_total") == 96
    assert _metric(s, "petals_chain_prompt_cached_tokens_total") == 64


def test_the_draft_models_failures_are_exported_at_each_scrape():
    """``DraftModel.failures`` (generations that went on without drafts) was in no metric: an operator could not see a
    broken draft model. Exported as ``petals_chain_speculative_draft_failures``, read when scraped; 0 without one."""
    s = Stats()
    s.watch_drafter(None)
    assert _metric(s, "petals_chain_speculative_draft_failures") == 0
    drafter = SimpleNamespace(failures=0)
    s.watch_drafter(drafter)
    assert _metric(s, "petals_chain_speculative_draft_failures") == 0
    drafter.failures = 3
    assert _metric(s, "petals_chain_speculative_draft_failures") == 3
