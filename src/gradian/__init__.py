"""Gradian: which training examples did this to my LoRA fine-tune?"""

__version__ = "0.1.0"
