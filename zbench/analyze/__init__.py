"""Reading run roots: curves, reports, regression gates, parity, and the ZeRO memory model."""
