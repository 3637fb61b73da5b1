"""Stage 7, validation: `verify` (retrain without the accused rows, against random controls) and `fidelity` (LOO and
LDS), on retrains from the adapter's recipe (`retrain`)."""
