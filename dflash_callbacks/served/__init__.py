"""Decoding as it is served at a temperature: a live speculative-sampling loop (`live`) and the
teacher-forced estimate trainers log (`teacher_forced`), to hold the offline numbers to."""
