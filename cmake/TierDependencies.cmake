# Finds every third-party dependency the standard way. scripts/install-deps.sh installs them.
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(TBB CONFIG REQUIRED)
find_package(hwy CONFIG REQUIRED)
find_package(nlohmann_json 3.10 CONFIG REQUIRED)

pkg_check_modules(URING REQUIRED IMPORTED_TARGET GLOBAL liburing>=2.0)

# libaio ships no pkg-config file on Debian; try pkg-config first, then the plain library.
if(TIER_WITH_AIO)
  pkg_check_modules(AIO QUIET IMPORTED_TARGET GLOBAL libaio)
  if(NOT AIO_FOUND)
    find_path(TIER_AIO_INCLUDE_DIR libaio.h)
    find_library(TIER_AIO_LIBRARY aio)
    if(TIER_AIO_INCLUDE_DIR AND TIER_AIO_LIBRARY)
      add_library(tier_aio_lib UNKNOWN IMPORTED GLOBAL)
      set_target_properties(tier_aio_lib PROPERTIES IMPORTED_LOCATION ${TIER_AIO_LIBRARY}
                                                    INTERFACE_INCLUDE_DIRECTORIES ${TIER_AIO_INCLUDE_DIR})
      add_library(PkgConfig::AIO ALIAS tier_aio_lib)
    else()
      message(WARNING "tier: libaio not found; building without the aio engine (install libaio-dev)")
      set(TIER_WITH_AIO OFF CACHE BOOL "" FORCE)
    endif()
  endif()
endif()

if(TIER_WITH_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "52")
    # PTX for sm_75 runs (JIT) on every GPU nvcc 13 supports; native code for Hopper.
    set(CMAKE_CUDA_ARCHITECTURES "75-virtual;90-real")
  endif()
  # CMake 3.25 knows no C++20 flag for nvcc: .cu files are C++17, so the public headers they
  # include stay C++17-clean.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
endif()

# NCCL, for the NCCL communicator (src/comm): its header at build time; libnccl.so.2 is loaded at
# run time (dlopen), so nothing links against it. On by default when CUDA, nccl.h and libnccl are
# found (the CUDA toolkit's folders, NCCL_HOME, or -DTIER_NCCL_INCLUDE_DIR / -DTIER_NCCL_LIBRARY).
set(_tier_nccl_default OFF)
if(TIER_WITH_CUDA)
  find_path(TIER_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} $ENV{NCCL_HOME}/include
            DOC "Directory holding nccl.h")
  find_library(TIER_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR} $ENV{NCCL_HOME}/lib
               DOC "libnccl, tried at run time after the plain soname libnccl.so.2")
  if(TIER_NCCL_INCLUDE_DIR AND TIER_NCCL_LIBRARY)
    set(_tier_nccl_default ON)
  endif()
endif()
option(TIER_WITH_NCCL "Build the NCCL communicator (on when CUDA and NCCL are found)" ${_tier_nccl_default})
if(TIER_WITH_NCCL AND NOT TIER_WITH_CUDA)
  message(FATAL_ERROR "TIER_WITH_NCCL needs TIER_WITH_CUDA=ON (NCCL runs on CUDA devices)")
endif()
if(TIER_WITH_NCCL AND NOT TIER_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR "TIER_WITH_NCCL: nccl.h not found; install NCCL (libnccl-dev), set NCCL_HOME or "
                      "-DTIER_NCCL_INCLUDE_DIR, or configure with -DTIER_WITH_NCCL=OFF")
endif()

if(TIER_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
# Google Benchmark is only for the kernel micro-benchmarks (bench/micro, tier-micro): optional.
set(TIER_BUILD_MICRO OFF)
if(TIER_BUILD_BENCH)
  find_package(benchmark CONFIG QUIET)
  if(benchmark_FOUND)
    set(TIER_BUILD_MICRO ON)
  else()
    message(STATUS "tier: Google Benchmark not found; the micro-benchmarks (tier-micro) are not built "
                   "(install libbenchmark-dev; tier-bench is built without it)")
  endif()
endif()
