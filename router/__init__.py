"""The macpool router: the pool's single OpenAI-compatible endpoint."""
