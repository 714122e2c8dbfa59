"""Tiny random models built offline (``tiny``) and ``lct demo``'s whole job on one (``run``).

May import every layer below the CLI.
"""
