"""Measuring a QuantMLA cache: decode perplexity, the dual-path error analysis, paired intervals."""
