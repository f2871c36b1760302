"""The ``megamoe`` command (``python -m megamoe``) and its subcommands: the top floor, which owns argument
parsing, usage errors and exit codes. Nothing in the library imports it.

- :mod:`megamoe.cli.main`: the dispatcher (``megamoe train|generate|convert|preprocess|inspect``);
- :mod:`megamoe.cli.launch`: what a torchrun entry point needs (process group, one-line errors);
- :mod:`megamoe.cli.train`: ``megamoe train`` (flags, ``--config`` TOML files, ``--nproc-per-node``);
- :mod:`megamoe.cli.run_config`: the TOML run config (sections, overrides, ``--print-config``);
- :mod:`megamoe.cli.generate`: ``megamoe generate``.
"""
