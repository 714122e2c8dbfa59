"""The ``lct`` command: one small module per subcommand over the library's API (``main`` holds
the group; ``_util`` the one-line errors, progress bars, ``-q``). Library errors describe the
problem; the CLI adds the hint (a flag to pass)."""
