"""The configuration model (settings, their validation and error messages, route
settings, client networks); imports nothing of the proxy outside this package."""
