"""The `qwen-jax` command (`main`) and the engine options shared by its subcommands
(`args`).

On top: may import the entry points, the engine's public modules, `serving.bench`, and
what the entry points may.
"""
