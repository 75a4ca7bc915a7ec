"""Mixed precision and the levers beside it: which precision a run uses and who chose it
(`precision`), the device facts that decide it (`hardware`), gradient checkpointing (`memory`) and
torch.compile (`compiling`)."""
