"""The tools beside the library: commands that measure, demonstrate and plan, built on it.

``bench/`` (``infir2 bench``, ``infir2 fidelity``), ``demo/`` (``infir2 demo`` and its generated
data), ``memory.py`` (``infir2 memory``), ``plan.py`` (``infir2 plan``), ``numerics.py``
(``infir2 numerics``), ``paired.py`` (the paired-seed arithmetic of the demo and fidelity reports),
``wire_bytes.py`` (FSDP2 all-gather byte counters for benchmarks), ``machine.py`` (the CPU line every
benchmark prints and the demo stores). The library below
(``fp8`` ... ``train``) never imports them.
"""
