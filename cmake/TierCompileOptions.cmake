# Warning flags, sanitizers and a helper that every tier module uses to declare its target.
add_library(tier_compile_options INTERFACE)
target_compile_options(tier_compile_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-missing-field-initializers
                            -Werror=unused-result -Werror=return-type>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${TIER_WERROR}>>:-Werror>
  # nvcc's front end (EDG) flags `status = other` as a dropped [[nodiscard]] Status& (#2810); the
  # host compiler still enforces unused-result on the same code, so that check is not lost.
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Werror=unused-result -diag-suppress=2810>)

if(TIER_SANITIZER STREQUAL "asan")
  set(_tier_san_flags -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
elseif(TIER_SANITIZER STREQUAL "tsan")
  set(_tier_san_flags -fsanitize=thread -fno-omit-frame-pointer)
elseif(NOT TIER_SANITIZER STREQUAL "none")
  message(FATAL_ERROR "TIER_SANITIZER must be none, asan or tsan (got '${TIER_SANITIZER}')")
endif()
if(_tier_san_flags)
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_tier_san_flags}>")
  add_link_options(${_tier_san_flags})
endif()

set(TIER_MODULE_TARGETS "" CACHE INTERNAL "")

# tier_add_module(<name> SOURCES ... [PUBLIC_LIBS ...] [PRIVATE_LIBS ...])
# Declares the static library tier_<name>, exported as tier::<name>.
function(tier_add_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_LIBS;PRIVATE_LIBS" ${ARGN})
  set(target tier_${name})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(tier::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME tier_${name})
  target_include_directories(${target}
    PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_LIBS} PRIVATE ${ARG_PRIVATE_LIBS}
                                          $<BUILD_INTERFACE:tier_compile_options>)
  set(TIER_MODULE_TARGETS ${TIER_MODULE_TARGETS} ${target} CACHE INTERNAL "")
endfunction()
