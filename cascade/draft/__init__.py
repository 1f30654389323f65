"""The draft model: its architecture, distillation data from the target, training and agreement.

``scripts/train_draft.py`` is the command line over this package.
"""
