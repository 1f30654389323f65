"""Ablation sweeps: a YAML grid of runs (``grid``), measuring one (``measure``), a resumable CSV
(``store``) and the plots (``plots``). ``scripts/ablate.py`` is the command line."""
