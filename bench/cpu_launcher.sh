#!/bin/bash
# A compiler and linker launcher that appends "user sys wall output" of each
# command to $CITIME_CPU_LOG (CMAKE_CXX_COMPILER_LAUNCHER and
# CMAKE_CXX_LINKER_LAUNCHER): per-object CPU seconds of a build, which a
# loaded machine leaves comparable where wall time is not. docs/TESTING.md,
# "The cold build and CI's time".
prev=; out=
for a; do [ "$prev" = -o ] && out=$a; prev=$a; done
exec /usr/bin/time -f "%U %S %e $out" -a -o "$CITIME_CPU_LOG" "$@"
