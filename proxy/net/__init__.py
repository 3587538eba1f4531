"""The network edge: framed sockets, TLS, SASL, the PROXY protocol and the bounded
client buffers; may import config, observe and routes."""
