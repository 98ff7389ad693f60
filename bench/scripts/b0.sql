-- B0: the floor, a bare one-row INSERT and commit.
INSERT INTO bench.b0_log DEFAULT VALUES;
