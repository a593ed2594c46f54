"""The serving engine, in layers; each subpackage may import only those before it
(tests/unit/test_layers.py holds the table):

    core -> parsers | structured_output | metrics -> sample -> executor -> engine
         -> entrypoints (openai/) -> cli | bench

Data flow, named once: scheduler output (core) -> model inputs (executor) -> jitted step
(executor, sample) -> sampled ids -> output processor (engine) -> request outputs.
"""
