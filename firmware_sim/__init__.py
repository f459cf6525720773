"""Emulated devices and the data they see: datasets, incremental scenarios, (later) limits and fleets."""
