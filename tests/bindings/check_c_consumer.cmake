# Installs tier into a scratch prefix and builds a C-only project that finds it with
# find_package(tier) and links tier::c, then runs it.
# Run with -DBUILD=<tier build dir> -DSRC=<consumer source dir> -DWORK=<scratch dir> -DGEN=<generator>.
file(REMOVE_RECURSE ${WORK})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD} --prefix ${WORK}/prefix
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed:\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC} -B ${WORK}/build -G ${GEN}
                        -DCMAKE_PREFIX_PATH=${WORK}/prefix -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure failed:\n${out}\n${err}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK}/build RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed:\n${out}\n${err}")
endif()
execute_process(COMMAND ${WORK}/build/tier_c_consumer ${WORK}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "tier 0\\.[0-9]+\\.[0-9]+ from C: .*\"tiers\"")
  message(FATAL_ERROR "consumer run failed (${rc}):\n${out}\n${err}")
endif()
message(STATUS "find_package(tier) C consumer built and ran:\n${out}")
