"""What a client meets: the OpenAI-compatible protocol and its routes, the operator's routes, the
guard in front of them (auth, limits, slow clients) and the streams that carry tokens back. It
speaks to an engine through the backend protocol (engine/backend.py) and knows no engine."""
