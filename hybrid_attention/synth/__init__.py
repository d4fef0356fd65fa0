"""The synthetic recall suite: Palindrome, MQAR and Stack (tasks.py), 2-layer KDA, Gated DeltaNet and MLA models
(models.py), runs and grids under a time budget (run.py), accuracy plots (plots.py), and the `hybrid-attention synth`
command (synth/cli.py). See docs/fidelity.md. Importing the package loads no torch (the command's parser needs none)."""
