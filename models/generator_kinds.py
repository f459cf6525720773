"""The class-generator kinds (architectures: models/generators.py), in a module of their own that imports nothing:
device code without torch, and the command line at start-up, check them without loading numpy or torch."""
from __future__ import annotations

GENERATOR_KINDS = ("wgan-gp", "vae", "conv-vae")
VAE_KINDS = ("vae", "conv-vae")  # trained as VAEs (the encoder is the auxiliary model); they have ORT artifacts
CONV_KINDS = ("wgan-gp", "conv-vae")  # two stride-2 upsamplings: spatial sizes divisible by 4
