"""Multi-process proofs: DDP and FSDP2 over gloo, a process pair per test with its own rendezvous."""
