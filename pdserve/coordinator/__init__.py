"""Request entry: OpenAI-compatible REST, P/D router and request lifecycle."""
