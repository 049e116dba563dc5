"""Settings: the XLA and framework flags audit (`flags`) and the environment report
(`environment`) of a host.
"""
