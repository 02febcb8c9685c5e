"""The websocket gateway: tokenization, the chat template, token streams back to clients."""
