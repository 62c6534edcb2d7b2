"""The router: one OpenAI-compatible endpoint in front of a pool of engines."""
