"""Prompt-lookup (n-gram) drafts: no weights."""
