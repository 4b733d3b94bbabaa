"""OpenAI Responses: its wire types (`schema`), translation to and from the canonical request
(`dialect`), and what the gateway serves of it (`routes.SERVED`)."""
