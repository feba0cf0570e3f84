"""Event-driven simulator of chain-structured LLM serving and the paper's §4.1 reproduction.

``python -m petals_chain.sim --help`` lists the commands; :mod:`petals_chain.sim.engine` holds the
simulators, :mod:`petals_chain.sim.scenarios` the paper's parameter sets and policies, and
:mod:`petals_chain.sim.data` the Azure trace / RIPE Atlas loaders with synthetic fallbacks.
"""
