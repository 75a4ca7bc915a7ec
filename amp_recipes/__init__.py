"""The library the mixed-precision fine-tuning recipes in `recipes/` share, by concern:

- `training`: the run around the loop (`TrainingRun`, the step's figures, checkpoints, outputs);
- `amp`: mixed precision and the levers beside it (precision, hardware, memory, compiling);
- `tasks`: the tasks and their data (classification, NER, QA, masked LM, the shipped metrics);
- `measure`: the measurement engine, the precision doctor and the reports;

and the modules they all use: `arguments` (the shared flags), `no_trainer` (standing in for
transformers' no_trainer examples), `errors`, `shipped` and `cli`. The training loop and the
`Accelerator` stay visible in each recipe; the module map is in `recipes/README.md`.
"""

__version__ = "0.1.0"
