"""pFedGRP's class generators on the device: the stored record, the bank, sampling and training (docs/generators.md).

Everything here but `torch_training` runs without torch."""
