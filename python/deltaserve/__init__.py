"""deltaserve: a serving engine for hybrid Gated DeltaNet + attention models."""
