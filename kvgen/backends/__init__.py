"""Compiler backends: each turns rendered sources into an artifact for one target arch."""

from .nvcc import (CompileError, CompileResult, KernelResources, Toolchain, ToolchainError, cache_key,
                   compile_shared_library, default_nvcc_candidates, find_toolchains, probe_toolchain,
                   toolchain_for)

__all__ = ["CompileError", "CompileResult", "KernelResources", "Toolchain", "ToolchainError", "cache_key",
           "compile_shared_library", "default_nvcc_candidates", "find_toolchains", "probe_toolchain",
           "toolchain_for"]
