# Warning flags for every target of the project (CXX only; nvcc gets its own in Cuda.cmake).
add_compile_options(
  $<$<COMPILE_LANGUAGE:CXX>:-Wall>
  $<$<COMPILE_LANGUAGE:CXX>:-Wextra>
  $<$<COMPILE_LANGUAGE:CXX>:-Wpedantic>
  $<$<COMPILE_LANGUAGE:CXX>:-Wshadow>
  $<$<COMPILE_LANGUAGE:CXX>:-Wnon-virtual-dtor>)
if(INFINIGEN_WERROR)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Werror>)
endif()
# clang: the embedded configuration texts are longer than the 64 KiB -Wpedantic asks of
# literals (both compilers take them); under the sanitizers, loops marked `omp simd` no longer
# vectorise, which clang reports as a failed transformation.
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-overlength-strings>)
  if(INFINIGEN_SANITIZE OR INFINIGEN_FUZZ)
    add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-Wno-pass-failed>)
  endif()
endif()
