"""What tests share: each module here is imported by several test modules, and no test module
imports another."""
