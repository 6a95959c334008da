"""Drafter training: the prompt set, self-distilled data, and the DFlash / EAGLE-3 recipes."""
